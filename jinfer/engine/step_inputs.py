"""One step's inputs as they cross to the device (and, in a multi-process group, to the other processes), and its
outputs as they come back.

A step is two executables (forward, then sampler) fed by two int32 buffers: the whole batch description packed
into one (`pack_batch`), the sampling parameters into another (`pack_sampling`); the jitted functions unpack them
by static slices. `StepInputs` is the executables' key plus the two buffers: what process 0 of a group sends the
others (jinfer/parallel/multihost.py). Shapes: T tokens, B sequences, P pages per sequence, R logits rows the
sampler takes (B when every sequence has at most one, one per sequence; else T: a sequence may return several,
its last positions, e.g. the drafts it verifies), L logits rows of the forward (R, or R + T in steps with prompt
logprobs). The sampler's results come back packed per logits row (`unpack_result`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import msgpack
import numpy as np

from jinfer.engine.sampling_tensors import SamplingTensors
from jinfer.models.batch import Batch


@dataclass(frozen=True)
class StepInputs:
    """Everything a process needs to launch one step: the executables' key and their two input buffers."""

    T: int  # tokens bucket
    B: int  # sequences bucket
    P: int  # pages bucket
    decode: int  # the forward's kind: 0 any step, 1 decode-only, Q > 1 a verify step's (`executables.py`)
    M: int  # output tokens per row given to the sampler (penalties)
    W: int  # words of the packed prompt-token mask per row
    num_logprobs: int
    flags: tuple[bool, ...]  # SamplerFlags fields, in order
    batch: np.ndarray  # int32, `pack_batch`
    sampling: np.ndarray  # int32, `pack_sampling`
    K: int = 0  # sparse logit biases per row (logit_bias, min_tokens)
    plp_k: int = -1  # prompt logprobs: top-k per prompt position (-1: none in this step)
    plp_targets: np.ndarray | None = None  # int32 [T]: the token each prompt position scores (-1 padding)
    R: int | None = None  # logits rows the sampler takes: B (None) or T (module doc)

    def __post_init__(self):
        if self.R is None:
            object.__setattr__(self, "R", self.B)
        if self.R not in (self.B, self.T):
            raise ValueError(f"R={self.R} must be B={self.B} or T={self.T}")

    @property
    def L(self) -> int:
        """Logits rows of the forward: the sampler's, then T prompt positions in steps with prompt logprobs."""
        return self.R + (self.T if self.plp_k >= 0 else 0)

    def to_wire(self) -> bytes:
        targets = None if self.plp_targets is None else self.plp_targets.astype(np.int32).tobytes()
        return msgpack.packb([self.T, self.B, self.P, self.decode, self.M, self.W, self.num_logprobs,
                              list(self.flags), self.batch.astype(np.int32).tobytes(),
                              self.sampling.astype(np.int32).tobytes(), self.K, self.plp_k, targets, self.R])

    @classmethod
    def from_wire(cls, frame: bytes) -> StepInputs:
        T, B, P, decode, M, W, n, flags, batch, sampling, K, plp_k, targets, R = msgpack.unpackb(frame)
        return cls(int(T), int(B), int(P), int(decode), int(M), int(W), int(n), tuple(bool(f) for f in flags),
                   np.frombuffer(batch, np.int32), np.frombuffer(sampling, np.int32), int(K), int(plp_k),
                   None if targets is None else np.frombuffer(targets, np.int32), int(R))


# ---- the batch buffer -------------------------------------------------------------------------------------------


def pack_batch(batch: Batch, prev_index: np.ndarray, shift_from: np.ndarray | None = None) -> np.ndarray:
    """One int32 buffer for the batch description (see `unpack_batch`). `prev_index` [T]: the row of the previous
    step's samples each token takes as its input id (-1: its id in the batch); `shift_from` [B] (None: all -1): where
    >= 0, the row of those samples' buffer holding the drafts the step in flight rejected of sequence b, by which its
    row moves back on the device (`device_step.shift_rows`)."""
    writes = batch.state_slots if batch.state_write_slots is None else batch.state_write_slots
    keep = np.zeros_like(batch.state_slots) if batch.state_keep is None else batch.state_keep
    shift = np.full_like(batch.seq_lens, -1) if shift_from is None else shift_from
    return np.concatenate([batch.input_ids, batch.positions, batch.slot_mapping, prev_index, batch.query_start,
                           batch.seq_lens, batch.logits_indices, batch.state_slots, writes, keep, shift,
                           batch.page_table.ravel()]).astype(np.int32)


def batch_sizes(T: int, B: int, P: int, L: int) -> tuple[int, ...]:
    """Lengths of the packed batch's parts, in `pack_batch` order (L: logits rows)."""
    return (T, T, T, T, B + 1, B, L, B, B, B, B, B * P)


def unpack_batch(buf: jax.Array, dims: tuple[int, int, int, int]) -> tuple[Batch, jax.Array, jax.Array]:
    """dims = (T, B, P, L): (the batch, prev_index, shift_from)."""
    T, B, P, _ = dims
    parts, o = [], 0
    for n in batch_sizes(*dims):
        parts.append(buf[o:o + n])
        o += n
    ids, pos, slots, prev, qs, lens, logits_idx, state_slots, writes, keep, shift, table = parts
    return Batch(ids, pos, slots, qs, lens, table.reshape(B, P), logits_idx, state_slots, writes, keep), prev, shift


# ---- the sampling buffer ----------------------------------------------------------------------------------------

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INT_FIELDS = ("top_k", "seeds", "steps", "shifts")  # (shifts: `SamplingTensors.shifts`)


def _i32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.int32).ravel()


def pack_sampling(t: SamplingTensors) -> np.ndarray:
    """One int32 buffer for the sampling parameters (floats and u32 by bit pattern)."""
    parts = [_i32(np.asarray(getattr(t, f), np.float32)) for f in _FLOAT_FIELDS]
    R = len(t.steps)
    shifts = np.full(R, -1, np.int32) if t.shifts is None else t.shifts
    parts += [_i32(t.top_k), _i32(t.seeds), _i32(t.steps), _i32(shifts), _i32(t.output_tokens), _i32(t.prompt_mask)]
    parts += [_i32(t.bias_ids), _i32(np.asarray(t.bias_values, np.float32))]
    if t.token_mask is not None and t.token_mask.size:
        R = t.token_mask.shape[0]
        rows = np.ones(R, np.int32) if t.mask_logprobs is None else np.asarray(t.mask_logprobs, np.int32)
        parts += [_i32(t.token_mask), rows]
    return np.concatenate(parts)


def sampling_size(R: int, M: int, W: int, K: int, G: int) -> int:
    """Length of the packed sampling buffer of R rows (G: words of the token mask, 0 without; with one, a flag per
    row follows it: `SamplingTensors.mask_logprobs`)."""
    return R * (len(_FLOAT_FIELDS) + len(_INT_FIELDS) + M + W + 2 * K + (G + 1 if G else 0))


def unpack_sampling(buf: jax.Array, dims: tuple[int, int, int, int], mask_words: int = 0) -> SamplingTensors:
    """dims = (R, M, W, K); `mask_words`: G of the grammar token mask that ends the buffer (0: none)."""
    R, M, W, K = dims
    o, out = 0, {}
    for f in _FLOAT_FIELDS + _INT_FIELDS:
        out[f] = buf[o:o + R]
        o += R
    for f in _FLOAT_FIELDS:
        out[f] = jax.lax.bitcast_convert_type(out[f], jnp.float32)
    out["seeds"] = jax.lax.bitcast_convert_type(out["seeds"], jnp.uint32)
    out["output_tokens"] = buf[o:o + R * M].reshape(R, M)
    o += R * M
    out["prompt_mask"] = jax.lax.bitcast_convert_type(buf[o:o + R * W], jnp.uint32).reshape(R, W)
    o += R * W
    out["bias_ids"] = buf[o:o + R * K].reshape(R, K)
    out["bias_values"] = jax.lax.bitcast_convert_type(buf[o + R * K:o + 2 * R * K], jnp.float32).reshape(R, K)
    o += 2 * R * K
    G = mask_words
    out["token_mask"] = jax.lax.bitcast_convert_type(buf[o:o + R * G], jnp.uint32).reshape(R, G)
    out["mask_logprobs"] = buf[o + R * G:o + R * G + R] if G else None
    return SamplingTensors(**out)


# ---- results ----------------------------------------------------------------------------------------------------


@dataclass
class StepResult:
    """Host copies of a step's samples, one row per logits row; `rows`: request id -> (first row, count) of each
    sequence that samples (one row per sequence, in batch order, unless some verify drafts)."""

    tokens: np.ndarray  # [R] i32
    logprobs: np.ndarray  # [R] f32, raw logprob of the sampled token
    top_ids: np.ndarray  # [R, N] i32
    top_logprobs: np.ndarray  # [R, N] f32
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    pooled: np.ndarray | None = None  # [R, hidden] f32: an embedding model's pooled rows (its tokens are dummies)
    ranks: np.ndarray | None = None  # [R] i32, the sampled token's 1-based rank under the raw logprobs

    def rows_of(self, request_id: str) -> range:
        first, count = self.rows[request_id]
        return range(first, first + count)

    def tokens_of(self, request_id: str) -> list[int]:
        """The tokens sampled at a sequence's logits rows (its last positions in the step), in order."""
        first, count = self.rows[request_id]
        return self.tokens[first:first + count].tolist()


@dataclass
class PromptLogprobs:
    """Host copies of a step's prompt logprobs: row i scores prompt position `Launched.prompt_rows[i]`."""

    logprobs: np.ndarray  # [N] f32, of the prompt token itself
    top_ids: np.ndarray  # [N, k] i32
    top_logprobs: np.ndarray  # [N, k] f32
    ranks: np.ndarray | None = None  # [N] i32, the prompt token's 1-based rank


def pack_samples(tokens, logprobs, ranks, top_ids, top_logprobs) -> jax.Array:
    """Traced: i32[R, 3 + 2N] (token, logprob bits, rank, top ids, top logprob bits), read back in one copy."""
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.concatenate([tokens[:, None], bits(logprobs)[:, None], ranks[:, None], top_ids, bits(top_logprobs)],
                           axis=1)


def packed_shape(rows: int, num_logprobs: int) -> tuple[int, int]:
    """The sampler's packed samples' shape (`pack_samples`) for `num_logprobs` top logprobs (< 0: none)."""
    return rows, 3 + 2 * max(num_logprobs, 0)


def unpack_result(packed: np.ndarray, rows: dict[str, tuple[int, int]]) -> StepResult:
    n = (packed.shape[1] - 3) // 2
    f32 = lambda x: np.ascontiguousarray(x).view(np.float32)
    return StepResult(packed[:, 0], f32(packed[:, 1]), packed[:, 3:3 + n], f32(packed[:, 3 + n:]), rows,
                      ranks=packed[:, 2])


def pooled_result(pooled: np.ndarray, rows: dict[str, tuple[int, int]]) -> StepResult:
    """An embedding model's step: its pooled rows, and a dummy token 0 per row (the request's one "output" token,
    with which the scheduler finishes it after its prompt)."""
    R = pooled.shape[0]
    empty = np.zeros((R, 0), np.int32)
    return StepResult(np.zeros(R, np.int32), np.zeros(R, np.float32), empty, empty.view(np.float32), rows,
                      pooled=pooled)


def unpack_prompt_logprobs(packed: np.ndarray, num_rows: int) -> PromptLogprobs:
    """From i32[T, 2 + 2k]: (logprob bits, rank, top ids, top logprob bits)."""
    packed = packed[:num_rows]
    k = (packed.shape[1] - 2) // 2
    f32 = lambda x: np.ascontiguousarray(x).view(np.float32)
    return PromptLogprobs(f32(packed[:, :1])[:, 0], packed[:, 2:2 + k], f32(packed[:, 2 + k:]), packed[:, 1])
