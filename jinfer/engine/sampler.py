"""On-device sampler: one batched, jit-compatible pure function with per-request parameters.

`sample(logits, t, num_logprobs)` runs inside the engine's jitted step, so it has no Python control
flow on traced values and only static shapes. The pipeline follows vLLM v1's sampler:

1. logprobs (if asked) = log_softmax of the RAW logits (vLLM's default `raw_logprobs` mode);
2. logit_bias and min_tokens (the EOS / stop ids at -inf while too few tokens exist): a sparse add;
   penalties: repetition (tokens seen in prompt or output: logit > 0 divided by r, < 0 times r),
   then frequency (minus f * count in output) and presence (minus p if in output);
3. greedy rows (temperature < 1e-5) take the argmax of the penalized logits;
4. the others: divide by temperature, min-p (drop p < min_p * p_max), top-k, then top-p on the
   top-k-renormalized distribution (keep the smallest prefix whose mass is >= top_p, at least one
   token), and draw with Gumbel-max; the noise of token v is a counter-based hash of
   (seed, step, v) (`_gumbel`).

vLLM v1 applies min-p BEFORE top-k/top-p (it is an "argmax-invariant logits processor"); v0 applied
it after. We follow v1. Top-k and min-p commute; top-p after min-p sees a renormalized distribution.

Cost. The step's `SamplerFlags` (static, computed on the host from the batch's parameters by
`SamplerFlags.of`) compile out what no row needs: all-greedy batches skip the noise and filters,
batches without penalties skip the scatter, batches whose every row is settled by the candidate sort
(below) skip the full sort. No predicate is read back from the device mid-step (a `lax.cond` on GPU costs a
device-to-host sync, which stalls a host that runs one step ahead). The filters become one logit
threshold per row, so only values are sorted (no argsort, no [B, V] ints).
XLA's sort (and `lax.top_k` for k > 16, which is a sort) of [256, 152k] f32 takes ~3 ms on an H100,
so top-k/top-p first sort a candidate set (`_candidates`): the NUM_GROUPS groups of GROUP_SIZE
consecutive tokens with the largest maxima, which hold every token above the next group's maximum.
That settles a row exactly when its top-k and the mass needed for its top-p lie among those tokens
(always for 0 < k <= NUM_GROUPS, with or without top-p: top-p then works inside the top k; typically
for nuclei of up to a few hundred tokens). Only batches with a row that may not be settled (top-p
without such a top-k: `SamplerFlags.full_sort`) compile the full-sort fallback, behind a `lax.cond`
(the one device-to-host read left, and only in that variant). The same candidates
give the top-N logprobs. Measured with `main()` on one H100, B=256, V=151936 (LM-like spiked
logits): greedy 0.29 ms, temperature 0.77 ms, + top-k/top-p 1.25 ms (4.6 ms when flat rows need the
full sort), + 20 logprobs 1.1 ms, + penalties 1.1 ms; at B=32: 0.18 / 0.30 / 0.44 / 1.6 / 0.38 /
0.34 ms. A Pallas radix-select kernel would remove the full-sort fallback.

Batch invariance: each row's threshold comes from the candidate sort or, only for rows it cannot
settle, the full sort; rows with filters off get -inf and keep bit-identical logits. Noise depends
only on (seed, step). So a seeded request draws the same token whatever else is in the batch and
wherever it sits in it.

Structured outputs: with `SamplerFlags.grammar` the raw logits first go through `apply_token_mask`
(`token_mask` u32[B, ceil(V/32)], a grammar's allowed tokens per row, packed like `prompt_mask`; rows
without a grammar are all ones). Batches without a grammar compile without it. allowed_token_ids rides on the
same mask, but its rows' logprobs are taken before it (`mask_logprobs` 0), as vLLM applies it after them.

Penalties' inputs and the host side: `sampling_tensors.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jinfer.engine.sampling_tensors import (
    ALL_FLAGS,
    GREEDY_EPS,
    GROUP_SIZE,
    NUM_GROUPS,
    SamplerFlags,
    SamplingTensors,
)


@jax.tree_util.register_dataclass
@dataclass
class SampleResult:
    tokens: jax.Array  # [B] i32, sampled ids
    logprobs: jax.Array  # [B] f32, raw logprob of the sampled id (0 when num_logprobs < 0)
    top_ids: jax.Array  # [B, N] i32, the N most likely ids under the raw logits, best first
    top_logprobs: jax.Array  # [B, N] f32, their raw logprobs
    # [B] i32, the sampled id's rank under the raw logits: 1 + the tokens more likely (ties count ahead, as vLLM's
    # count of logprobs >= it); 0 when num_logprobs < 0
    ranks: jax.Array = None


def _unpack_token_mask(mask: jax.Array, vocab_size: int) -> jax.Array:
    """u32[B, W] packed bitset -> bool[B, V]; elementwise, so XLA fuses it into its consumer."""
    B, W = mask.shape
    words = jnp.broadcast_to(mask[:, :, None], (B, W, 32)).reshape(B, W * 32)[:, :vocab_size]
    shift = jnp.arange(vocab_size, dtype=jnp.uint32) & 31
    return ((words >> shift) & 1).astype(jnp.bool_)


def apply_token_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Structured outputs: -inf for the tokens a row's grammar forbids (`mask` u32[B, ceil(V/32)], bit
    v % 32 of word v // 32 = token v allowed). Applied to the raw logits, so logprobs are those of the
    constrained distribution, as in vLLM; one fused select, only in the `grammar` sampler variant."""
    return jnp.where(_unpack_token_mask(mask, logits.shape[1]), logits, -jnp.inf)


def _repeat(x: jax.Array, r: jax.Array) -> jax.Array:
    return jnp.where(x > 0, x / r, x * r)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Repetition, frequency and presence penalties (vLLM semantics) on f32[B, V] logits."""
    logits = jnp.asarray(logits)
    B, V = logits.shape
    ids = t.output_tokens  # [B, M]
    has_prompt = t.prompt_mask.shape[1] > 0
    if ids.shape[1] == 0 and not has_prompt:
        return logits
    rep = jnp.where(t.repetition_penalty > 0, t.repetition_penalty, 1.0)[:, None]  # [B, 1]

    def penalize(logits):
        if has_prompt:
            in_prompt = _unpack_token_mask(t.prompt_mask, V)  # [B, V] bool, fused
            logits = jnp.where(in_prompt, _repeat(logits, rep), logits)
        if ids.shape[1] == 0:
            return logits
        valid = ids >= 0
        safe = jnp.where(valid, ids, 0)
        rows = jnp.arange(B)[:, None]
        # Each output id gets repetition (unless the prompt already applied it) and presence, via a
        # set: duplicates compute the same value, so which one wins does not matter.
        x = jnp.take_along_axis(logits, safe, axis=1)  # [B, M]
        if has_prompt:
            word = jnp.take_along_axis(t.prompt_mask, safe >> 5, axis=1)  # [B, M]
            done = ((word >> (safe & 31).astype(jnp.uint32)) & 1).astype(jnp.bool_)
        else:
            done = jnp.zeros_like(valid)
        x = jnp.where(done, x, _repeat(x, rep)) - t.presence_penalty[:, None]
        scatter_ids = jnp.where(valid, ids, V)  # out of range: dropped
        logits = logits.at[rows, scatter_ids].set(x, mode="drop")
        # Frequency: every occurrence subtracts f once.
        f = jnp.broadcast_to(-t.frequency_penalty[:, None], ids.shape)
        return logits.at[rows, scatter_ids].add(f, mode="drop")

    return penalize(logits)


def apply_bias(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Add the sparse per-row biases (logit_bias, min_tokens' -inf) to f32[B, V] logits."""
    if t.bias_ids is None or t.bias_ids.shape[1] == 0:
        return logits
    B, V = logits.shape
    ids = jnp.where(t.bias_ids >= 0, t.bias_ids, V)  # padding: out of range, dropped
    return logits.at[jnp.arange(B)[:, None], ids].add(t.bias_values, mode="drop")


def _candidates(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A small candidate set holding every token above `cut`: values, ids ([B, n], unsorted), cut [B, 1].

    Groups of GROUP_SIZE consecutive tokens are ranked by their max; the top NUM_GROUPS groups hold
    every token greater than the next group's max (`cut`), so at least NUM_GROUPS of them. A vocab of
    at most NUM_GROUPS groups is returned whole with cut = -inf.
    """
    B, V = x.shape
    n_groups = -(-V // GROUP_SIZE)
    if n_groups <= NUM_GROUPS:
        return x, jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V)), jnp.full((B, 1), -jnp.inf)
    pad = n_groups * GROUP_SIZE - V
    xg = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else x
    xg = xg.reshape(B, n_groups, GROUP_SIZE)
    gmax, gidx = lax.top_k(jnp.max(xg, axis=-1), NUM_GROUPS + 1)  # [B, G + 1]
    gidx = gidx[:, :NUM_GROUPS]
    vals = xg[jnp.arange(B)[:, None], gidx].reshape(B, -1)  # [B, G * S]
    ids = (gidx[:, :, None] * GROUP_SIZE + jnp.arange(GROUP_SIZE, dtype=jnp.int32)).reshape(B, -1)
    return vals, ids, gmax[:, NUM_GROUPS:]


def _thresholds(s: jax.Array, cut: jax.Array, z_all: jax.Array, top: jax.Array, top_k: jax.Array,
                top_p: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Top-k then top-p logit threshold [B, 1] (-inf: both off) from candidates `s` sorted descending.

    `s` must hold every token > `cut` (all tokens when cut = -inf); `z_all` = sum(exp(x - top)) over
    the whole row. Also returns whether `s` sufficed (else the caller redoes the row on the full sort).
    """
    n = s.shape[1]
    k_on = ((top_k > 0) & (top_k < vocab_size))[:, None]
    p_on = (top_p < 1)[:, None]
    k = jnp.clip(top_k, 1, n)[:, None]
    kth = jnp.take_along_axis(s, k - 1, axis=1)  # [B, 1]
    exact_all = cut == -jnp.inf
    ok_k = ~k_on | ((top_k[:, None] <= n) & ((kth > cut) | exact_all))
    kth = jnp.where(k_on, kth, -jnp.inf)
    # Ties with the k-th value are kept, as in vLLM (which masks logits < k-th value).
    e = jnp.where(s >= kth, jnp.exp(s - top), 0.0)  # [B, n]
    z = jnp.where(k_on, jnp.sum(e, axis=1, keepdims=True), z_all)  # top-k renormalizes for top-p
    cum = jnp.cumsum(e, axis=1) / z
    before = jnp.concatenate([jnp.zeros_like(cum[:, :1]), cum[:, :-1]], axis=1)  # mass of better tokens
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=1, keepdims=True), 1)  # keep >= 1
    pth = jnp.where(p_on, jnp.take_along_axis(s, n_keep - 1, axis=1), -jnp.inf)
    # The nucleus is exact if the tokens known to be exact (those > cut) already reach top_p.
    n_exact = jnp.sum(s > cut, axis=1, keepdims=True)
    exact_mass = jnp.take_along_axis(cum, jnp.maximum(n_exact - 1, 0), axis=1) * (n_exact > 0)
    ok_p = ~p_on | (exact_mass >= top_p[:, None]) | exact_all
    return jnp.maximum(kth, pth), (ok_k & ok_p)[:, 0]


def _top_k_top_p_threshold(x: jax.Array, needs: jax.Array, top_k: jax.Array, top_p: jax.Array,
                           full_sort: bool = True) -> jax.Array:
    """Per-row threshold f32[B, 1]: from the candidate sort, or for rows it cannot settle the full sort
    (compiled only with `full_sort`: without it the caller guarantees every row is settled).

    Every row takes the same path whatever the rest of the batch does (the full sort only overrides
    the rows that need it), so a seeded row does not depend on its neighbours.
    """
    B, V = x.shape
    top = jnp.max(x, axis=1, keepdims=True)
    z_all = jnp.sum(jnp.exp(x - top), axis=1, keepdims=True)
    vals, _, cut = _candidates(x)
    s = jnp.sort(vals, axis=1, descending=True)
    threshold, ok = _thresholds(s, cut, z_all, top, top_k, top_p, V)
    ok = ok | ~needs
    if not full_sort:
        return threshold

    def full_sort_threshold(x):
        s = jnp.sort(x, axis=1, descending=True)  # [B, V] values only
        return _thresholds(s, jnp.full((B, 1), -jnp.inf), z_all, top, top_k, top_p, V)[0]

    fallback = lax.cond(jnp.all(ok), lambda x: jnp.full((B, 1), -jnp.inf), full_sort_threshold, x)
    return jnp.where(ok[:, None], threshold, fallback)


def processed_logits(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags = ALL_FLAGS) -> jax.Array:
    """What the random rows draw from: penalties, temperature, min-p, top-k, top-p (-inf = dropped).

    Greedy rows are left at temperature 1 and unfiltered (their token is the argmax anyway).
    """
    logits = apply_bias(logits.astype(jnp.float32), t)
    if flags.penalties:
        logits = apply_penalties(logits, t)
    return _filter(logits, t, flags)


def _filter(logits: jax.Array, t: SamplingTensors, flags: SamplerFlags) -> jax.Array:
    V = logits.shape[1]
    greedy = t.temperature < GREEDY_EPS
    x = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
    top = jnp.max(x, axis=-1, keepdims=True)
    # min-p in log space: p < min_p * p_max  <=>  logit < max_logit + log(min_p).
    min_p = t.min_p[:, None]
    cutoff = jnp.where(min_p > 0, top + jnp.log(jnp.where(min_p > 0, min_p, 1.0)), -jnp.inf)
    x = jnp.where(x < cutoff, -jnp.inf, x)
    needs = ~greedy & (((t.top_k > 0) & (t.top_k < V)) | (t.top_p < 1))
    threshold = _top_k_top_p_threshold(x, needs, t.top_k, t.top_p, flags.full_sort)
    return jnp.where(x >= threshold, x, -jnp.inf)


def _mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finalizer: a bijection on u32 whose every output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _gumbel(seeds: jax.Array, steps: jax.Array, vocab_size: int) -> jax.Array:
    """f32[B, V] Gumbel noise; row b depends only on (seeds[b], steps[b]).

    A counter-based hash (seed, step, token id) -> 23 uniform bits, not `jax.random`: threefry
    compiled to ~0.7 s per sampler variant on CPU and costs more on the device; Gumbel-max only needs
    independent-looking uniforms per (request, step, token). Two mixing rounds key each row, one more
    mixes in the token id.
    """
    row = _mix32(_mix32(seeds.astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9)) + steps.astype(jnp.uint32))  # [B]
    ids = jnp.arange(vocab_size, dtype=jnp.uint32) * jnp.uint32(0x9E3779B9)
    bits = _mix32(row[:, None] ^ ids[None, :])  # [B, V]
    u = ((bits >> 9).astype(jnp.float32) + 0.5) * (1.0 / (1 << 23))  # (0, 1) exactly in f32, never 0 or 1
    return -jnp.log(-jnp.log(u))


def sample(logits: jax.Array, t: SamplingTensors, num_logprobs: int = 0,
           flags: SamplerFlags | None = None) -> SampleResult:
    """Sample one token per row of f32/bf16[B, V] logits under per-row parameters `t`.

    `num_logprobs` (static): N top logprobs to return per row (the max over the batch); 0 returns the
    sampled token's logprob only, < 0 skips logprob work (logprobs 0, top arrays [B, 0]).
    Logprobs are of the raw logits, before penalties and temperature (vLLM v1 default).
    `flags` (static) picks the compiled variant; None derives them from `t` (which must then be on
    the host: numpy or concrete arrays).
    """
    return _sample_jit(logits, t, num_logprobs, SamplerFlags.of(t) if flags is None else flags)


def sample_traced(logits: jax.Array, t: SamplingTensors, num_logprobs: int, flags: SamplerFlags) -> SampleResult:
    """`sample` for use inside another traced function (no jit of its own)."""
    B, V = logits.shape
    assert t.temperature.shape == (B,), (t.temperature.shape, logits.shape)
    raw = logits.astype(jnp.float32)
    if flags.grammar:
        masked = apply_token_mask(raw, t.token_mask)
        # logprobs see a grammar's mask, not allowed_token_ids' (vLLM's order); one fused select
        raw = masked if t.mask_logprobs is None else jnp.where(t.mask_logprobs[:, None] != 0, masked, raw)
        logits = apply_bias(masked, t)
    else:
        logits = apply_bias(raw, t)
    logits = apply_penalties(logits, t) if flags.penalties else logits
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if flags.sampling:
        greedy = t.temperature < GREEDY_EPS
        x = _filter(logits, t, flags) + _gumbel(t.seeds, t.steps, V)
        tokens = jnp.where(greedy, greedy_tokens, jnp.argmax(x, axis=-1).astype(jnp.int32))
    else:
        tokens = greedy_tokens

    N = max(num_logprobs, 0)
    if num_logprobs < 0:
        return SampleResult(tokens, jnp.zeros((B,), jnp.float32), jnp.zeros((B, 0), jnp.int32),
                            jnp.zeros((B, 0), jnp.float32), jnp.zeros((B,), jnp.int32))
    lse = jax.nn.logsumexp(raw, axis=-1)  # [B]
    chosen_raw = jnp.take_along_axis(raw, tokens[:, None], axis=1)  # [B, 1]
    chosen = chosen_raw[:, 0] - lse
    ranks = _rank(raw, chosen_raw)
    if N == 0:
        top_vals, top_ids = jnp.zeros((B, 0)), jnp.zeros((B, 0), jnp.int32)
    elif N <= NUM_GROUPS:  # the top N tokens are among the candidates
        vals, ids, _ = _candidates(raw)
        top_vals, pos = lax.top_k(vals, N)
        top_ids = jnp.take_along_axis(ids, pos, axis=1)
    else:
        top_vals, top_ids = lax.top_k(raw, N)
    return SampleResult(tokens, chosen, top_ids.astype(jnp.int32), top_vals - lse[:, None], ranks)


def _rank(raw: jax.Array, chosen: jax.Array) -> jax.Array:
    """i32[B]: how many of a row's f32[B, V] raw logits are >= its chosen one [B, 1] (vLLM's rank, 1-based: the
    chosen counts itself); a compare and a sum that XLA fuses, no [B, V] array is kept."""
    return jnp.sum(raw >= chosen, axis=1, dtype=jnp.int32)


_sample_jit = jax.jit(sample_traced, static_argnames=("num_logprobs", "flags"))


def token_logprobs(logits: jax.Array, targets: jax.Array, k: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prompt logprobs: for f32[N, V] logits and the i32[N] token each row predicts, the raw logprob of that
    token [N], its rank [N] (as `SampleResult.ranks`), and the top-k ids [N, k] with their logprobs [N, k] (k static,
    0 allowed). Rows whose target is negative (padding) give garbage that the caller ignores."""
    raw = logits.astype(jnp.float32)
    N = raw.shape[0]
    lse = jax.nn.logsumexp(raw, axis=-1)  # [N]
    target_raw = jnp.take_along_axis(raw, jnp.maximum(targets, 0)[:, None], axis=1)  # [N, 1]
    chosen, ranks = target_raw[:, 0] - lse, _rank(raw, target_raw)
    if k == 0:
        return chosen, ranks, jnp.zeros((N, 0), jnp.int32), jnp.zeros((N, 0), jnp.float32)
    vals, ids, _ = _candidates(raw)  # the top k (<= NUM_GROUPS) tokens are among the candidates
    top_vals, pos = lax.top_k(vals, k)
    return chosen, ranks, jnp.take_along_axis(ids, pos, axis=1).astype(jnp.int32), top_vals - lse[:, None]



def main() -> None:
    """Benchmark: `python -m jinfer.engine.sampler [B] [V]` times `sample` per parameter mix."""
    import sys
    import time

    B = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    V = int(sys.argv[2]) if len(sys.argv) > 2 else 151936
    rng = np.random.default_rng(0)
    # LM-like rows: Gaussian logits plus 64 spiked tokens per row; flat rows defeat the candidates.
    peaked = rng.normal(0, 2, (B, V)).astype(np.float32)
    peaked[np.arange(B)[:, None], rng.integers(0, V, (B, 64))] += rng.uniform(6, 14, (B, 64))
    peaked = jax.device_put(peaked)
    flat = jax.device_put(rng.normal(0, 0.3, (B, V)).astype(np.float32))
    prompt, out = list(rng.integers(0, V, 2000)), list(rng.integers(0, V, 500))
    cases = {  # name: (params, num_logprobs, logits)
        "greedy, no logprobs": (dict(temperature=0.0), -1, peaked),
        "greedy": (dict(temperature=0.0), 0, peaked),
        "temperature 0.8": (dict(temperature=0.8), 0, peaked),
        "top_k 20 + top_p 0.95 (Qwen3)": (dict(temperature=0.6, top_k=20, top_p=0.95), 0, peaked),
        "top_p 0.9": (dict(temperature=0.8, top_p=0.9), 0, peaked),
        "min_p 0.05": (dict(temperature=0.8, min_p=0.05), 0, peaked),
        "top_p 0.9, flat: full sort": (dict(temperature=0.8, top_p=0.9), 0, flat),
        "penalties (M=512, prompt mask)": (dict(temperature=0.8, frequency_penalty=0.5,
                                                repetition_penalty=1.1), 0, peaked),
        "temperature 0.8, 20 logprobs": (dict(temperature=0.8), 20, peaked),
    }
    print(f"sample() on {jax.devices()[0].device_kind}, B={B}, V={V}")
    for name, (p, n, logits) in cases.items():
        t = jax.device_put(SamplingTensors.from_params([(p, out, prompt, 0)] * B, V))
        jax.block_until_ready(sample(logits, t, n))
        times = []
        for _ in range(20):
            start = time.perf_counter()
            jax.block_until_ready(sample(logits, t, n))
            times.append(time.perf_counter() - start)
        print(f"  {name:34s} {1e3 * np.median(times):8.3f} ms")


if __name__ == "__main__":
    main()
