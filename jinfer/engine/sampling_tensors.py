"""Host side of the sampler: each batch row's sampling parameters as arrays (`SamplingTensors`, built from vLLM-style
`SamplingParams` per row), and the static `SamplerFlags` of a batch (which compiled sampler variant it needs).

Penalty inputs (chosen so that nothing [B, V]-sized crosses the host link per step except when a
row uses repetition penalty, and so that no [B, V] count array is built on device):
- `output_tokens` i32[B, M]: ids generated so far, -1 padded. Only rows with a penalty need theirs
  (others may be all -1), and M may be 0 when no row has one. Counts are never materialized: the
  penalties are gathered/scattered at these B*M positions (duplicates subtract f once each).
- `prompt_mask` u32[B, W]: the set of prompt token ids as a packed bitset, W = ceil(V / 32), bit
  (v % 32) of word v // 32 set iff token v is in the prompt (see `pack_token_mask`). Fixed size
  whatever the prompt length (no prompt-length bucket to compile for), ~19 KB per row at V=152k,
  and the engine can pack it once per request. W may be 0 when no row uses repetition penalty
  (then repetition applies to output tokens only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

# Below this temperature sampling is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5
# Top-k/top-p/top-N candidates: the NUM_GROUPS groups of GROUP_SIZE tokens with the largest maxima
# (8192 tokens), sorted instead of the whole vocab. See `_candidates`.
GROUP_SIZE = 64
NUM_GROUPS = 128



@jax.tree_util.register_dataclass
@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch; padding rows are allowed (use `from_params`)."""

    temperature: jax.Array  # [B] f32, < GREEDY_EPS: greedy
    top_k: jax.Array  # [B] i32, <= 0 or >= V: off
    top_p: jax.Array  # [B] f32, >= 1: off
    min_p: jax.Array  # [B] f32, <= 0: off
    presence_penalty: jax.Array  # [B] f32, 0: off
    frequency_penalty: jax.Array  # [B] f32, 0: off
    repetition_penalty: jax.Array  # [B] f32, 1: off (<= 0 is treated as off)
    seeds: jax.Array  # [B] u32, per-request seed
    steps: jax.Array  # [B] i32, tokens generated so far by the request (folded into its key)
    output_tokens: jax.Array  # [B, M] i32, generated ids, -1 padded; M may be 0
    prompt_mask: jax.Array  # [B, W] u32, packed prompt token set, W = ceil(V/32) or 0
    # Sparse additions to the logits (logit_bias; -inf for the EOS / stop ids masked while fewer than
    # min_tokens tokens exist), applied before the penalties as in vLLM. K may be 0 (compiled out).
    bias_ids: jax.Array = None  # [B, K] i32, -1 padded
    bias_values: jax.Array = None  # [B, K] f32
    # [B, G] u32, tokens a grammar (and allowed_token_ids) allows (same packing; all ones for rows without one),
    # G = ceil(V/32) or 0
    token_mask: jax.Array = None
    # [B] i32 (with a token mask): 1 where the mask also masks the logprobs (a grammar's, as vLLM applies its bitmask
    # before the sampler), 0 where it applies after them (allowed_token_ids, as vLLM). None: every row is 1.
    mask_logprobs: jax.Array = None
    # [B] i32 (None: all -1): where >= 0, the row of the previous step's sampled-ids buffer holding how many drafts the
    # step in flight rejected of the row's sequence; its step moves back by that many (`device_step.sample_step`)
    shifts: jax.Array = None

    @classmethod
    def from_params(
        cls,
        rows: Sequence[tuple[Any, Sequence[int], Any, int | None]],
        vocab_size: int,
        *,
        num_seqs: int | None = None,
        output_len: int | None = None,
        rng: np.random.Generator | None = None,
        min_tokens_ids: Sequence[Sequence[int]] | None = None,
        banned_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingTensors:
        """Host-side builder from `(params, output_ids, prompt, step)` per request (numpy leaves).

        `params` is any object with vLLM `SamplingParams` attribute names, or a Mapping of them
        (missing ones take vLLM's defaults). `prompt` is a sequence of prompt ids, or a bitset from
        `pack_token_mask` (cache that object per request), or None. `step` None means `len(output_ids)`.
        Rows are padded to `num_seqs` (greedy, no penalties). `output_len` is the static M; by default
        the next power of two that holds the longest output of a penalized row (0 if none). A request
        without a seed gets one drawn from `rng`. `min_tokens_ids[b]`: the ids row b may not sample while
        its step is below `min_tokens` (EOS and stop ids); `banned_ids[b]`: ids row b may not sample (bad_words);
        its `logit_bias` is added as given.
        """
        B = num_seqs or len(rows)
        if len(rows) > B:
            raise ValueError(f"{len(rows)} rows exceed num_seqs={B}")
        rng = rng or np.random.default_rng()
        f32 = lambda fill: np.full(B, fill, np.float32)
        t = dict(temperature=f32(0.0), top_p=f32(1.0), min_p=f32(0.0), presence_penalty=f32(0.0),
                 frequency_penalty=f32(0.0), repetition_penalty=f32(1.0))
        top_k = np.zeros(B, np.int32)
        seeds = np.zeros(B, np.uint32)
        steps = np.zeros(B, np.int32)
        drawn = rng.integers(0, 2**32, size=B, dtype=np.uint32)  # one draw for every unseeded row
        penalized, repeated, biased = [], [], []
        read: dict[int, tuple] = {}  # rows sharing one params object (one generate() call's) read it once
        columns = [t[name] for name in _DEFAULTS]
        for b, (params, output_ids, prompt, step) in enumerate(rows):
            r = read.get(id(params))
            if r is None:
                r = read[id(params)] = _row_params(params)
            values, top_k[b], seed, row_penalized, logit_bias, min_tokens = r
            for column, value in zip(columns, values):
                column[b] = value
            seeds[b] = drawn[b] if seed is None else seed
            steps[b] = len(output_ids) if step is None else step
            if row_penalized:
                penalized.append((b, output_ids))
            if t["repetition_penalty"][b] != 1 and prompt is not None:
                repeated.append((b, prompt))
            bias = dict(logit_bias)  # a copy: rows sharing the params share the dict
            if min_tokens_ids is not None and steps[b] < min_tokens:
                bias.update((int(i), -np.inf) for i in min_tokens_ids[b])
            if banned_ids is not None and banned_ids[b]:
                bias.update((int(i), -np.inf) for i in banned_ids[b])
            if bias:
                biased.append((b, bias))

        longest = max((len(ids) for _, ids in penalized), default=0)
        M = output_len if output_len is not None else (1 << (longest - 1).bit_length() if longest else 0)
        if longest > M:
            raise ValueError(f"output of {longest} tokens exceeds output_len={M}")
        output_tokens = np.full((B, M), -1, np.int32)
        for b, ids in penalized:
            output_tokens[b, :len(ids)] = ids
        prompt_mask = np.zeros((B, _num_words(vocab_size) if repeated else 0), np.uint32)
        for b, prompt in repeated:
            prompt_mask[b] = prompt if isinstance(prompt, PackedTokenMask) else pack_token_mask(
                prompt, vocab_size)
        longest = max((len(d) for _, d in biased), default=0)
        K = 1 << (longest - 1).bit_length() if longest else 0
        bias_ids, bias_values = np.full((B, K), -1, np.int32), np.zeros((B, K), np.float32)
        for b, d in biased:
            bias_ids[b, :len(d)], bias_values[b, :len(d)] = list(d), list(d.values())
        return cls(**t, top_k=top_k, seeds=seeds, steps=steps, output_tokens=output_tokens,
                   prompt_mask=prompt_mask, bias_ids=bias_ids, bias_values=bias_values,
                   token_mask=np.zeros((B, 0), np.uint32))



@dataclass(frozen=True)
class SamplerFlags:
    """Static switches of one compiled sampler variant (what at least one row of the batch needs).

    Each is a superset switch: a variant with a flag on gives rows that do not need it the same
    result as a variant with it off, bit for bit (so a seeded row does not depend on its batch).
    Sampled rows always go through the top-k/top-p threshold (off rows get -inf): one variant less to
    compile for ~0.5 ms at B=256 on an H100.
    """

    sampling: bool = True  # some row is not greedy (else: argmax only)
    full_sort: bool = True  # some sampled row may need the full-sort fallback (top-p without a small top-k)
    penalties: bool = True  # some row uses a repetition/frequency/presence penalty
    grammar: bool = False  # some row is constrained by a grammar: `token_mask` masks the logits first

    @classmethod
    def of(cls, t: SamplingTensors) -> SamplerFlags:
        """The flags a batch needs, from host (numpy) parameters."""
        sampled, full_sort = sort_flags(t.temperature, t.top_k, t.top_p)
        rep = np.asarray(t.repetition_penalty)
        penalties = bool(np.any((np.asarray(t.presence_penalty) != 0) | (np.asarray(t.frequency_penalty) != 0)
                                | ((rep != 1) & (rep > 0))))
        return cls(sampling=bool(sampled.any()), full_sort=bool(full_sort.any()),
                   penalties=penalties, grammar=t.token_mask is not None and t.token_mask.shape[1] > 0)

    @classmethod
    def warm(cls) -> tuple[SamplerFlags, ...]:
        """The variants compiled at start-up (penalties compile on first use)."""
        return GREEDY_FLAGS, cls(full_sort=False, penalties=False), cls(penalties=False)


def sort_flags(temperature, top_k, top_p) -> tuple[np.ndarray, np.ndarray]:
    """(sampled, full_sort) per row (numpy arrays or scalars; top_k 0: off): whether a row samples, and whether it
    needs the full sort (top-p outside a small top-k; top-k past the candidates)."""
    temp, top_k, top_p = (np.asarray(a) for a in (temperature, top_k, top_p))
    sampled = temp >= GREEDY_EPS
    small_k = (top_k > 0) & (top_k <= NUM_GROUPS)  # top-k (and top-p inside it) settled by the candidates
    return sampled, sampled & (((top_p < 1) & ~small_k) | (top_k > NUM_GROUPS))


ALL_FLAGS = SamplerFlags()
GREEDY_FLAGS = SamplerFlags(sampling=False, full_sort=False, penalties=False)


class PackedTokenMask(np.ndarray):
    """u32[W] packed token bitset (a marker subclass so `from_params` can tell it from a prompt)."""


_DEFAULTS = dict(temperature=1.0, top_p=1.0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                 repetition_penalty=1.0)
_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")  # `_penalized`'s arguments
_PENALTY_AT = tuple(list(_DEFAULTS).index(name) for name in _PENALTIES)


def _row_params(params: Any) -> tuple:
    """What `from_params` reads from one request's parameters (the same for every step): (the _DEFAULTS fields in
    their order, top_k (0: off), seed mod 2**32 or None, `uses_penalties`, logit_bias as a dict, min_tokens)."""
    get = params.get if isinstance(params, Mapping) else lambda name: getattr(params, name, None)

    def val(name: str, default: Any) -> Any:
        value = get(name)
        return default if value is None else value

    values = tuple(val(name, default) for name, default in _DEFAULTS.items())
    seed = val("seed", None)
    return (values, max(int(val("top_k", -1)), 0), None if seed is None else int(seed) % 2**32,
            _penalized(values[_PENALTY_AT[0]], values[_PENALTY_AT[1]], values[_PENALTY_AT[2]]),
            dict(val("logit_bias", None) or ()),
            int(val("min_tokens", 0)))


def _param(params: Any, name: str, default: Any) -> Any:
    value = params.get(name) if isinstance(params, Mapping) else getattr(params, name, None)
    return default if value is None else value


def uses_penalties(params: Any) -> bool:
    """Whether a request's parameters ask for any repetition, frequency or presence penalty."""
    return _penalized(*(_param(params, name, _DEFAULTS[name]) for name in _PENALTIES))


def _penalized(presence: float, frequency: float, repetition: float) -> bool:
    return bool(presence or frequency or repetition != 1)


def _num_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


mask_words = _num_words  # words of a packed token bitset over the vocab


def pack_token_mask(token_ids: Sequence[int], vocab_size: int) -> PackedTokenMask:
    """Host-side: the set of `token_ids` as u32[ceil(V/32)], bit v % 32 of word v // 32 = token v."""
    bits = np.zeros(_num_words(vocab_size) * 32, np.bool_)
    bits[np.asarray(token_ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32).view(PackedTokenMask)


def num_logprobs_for(params_list: Sequence[Any]) -> int:
    """The static `num_logprobs` for a batch: max requested top-N, or -1 if no request wants any."""
    return max((int(n) for p in params_list if (n := _param(p, "logprobs", None)) is not None), default=-1)

