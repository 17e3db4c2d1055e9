"""Qwen3.5's short depthwise causal conv1d + SiLU over a ragged batch (the Gated DeltaNet layers' q | k | v
inputs), each sequence continuing from its conv ring, as one Pallas kernel.

Row t of the step (sequence b = seq[t], at position positions[t], offset r = t - starts[b] among b's new rows)
takes, for each tap d = 0..K-1 (d positions back): this step's row t - d if r >= d, else its sequence's input
at position p = positions[t] - d from the ring (row p mod K of its slot; zero before position 0). XLA's form of
this (`conv_reference`: a gather per tap, selects) ran at about half the copy rate in the offline profile of
Qwen3.5-4B (~200-250 us a layer for 8k rows of 8192 channels: 128 MB in, 128 MB out). Here one program per
block of rows x channels: the four taps of x are shifted loads of the same block (L1/L2 hits after the first),
the ring is read only where a row's tap reaches before this step's rows (a masked gather: the lanes masked off
issue no load), and y is written once in the activation dtype.

The ring's update (each sequence's newest K inputs written to its slot) stays in XLA (`ring_update`: a few
rows per sequence).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def conv_reference(x: jax.Array, conv_state: jax.Array, weight: jax.Array, seq: jax.Array, starts: jax.Array,
                   slots: jax.Array, positions: jax.Array) -> jax.Array:
    """y [T, C] in x's dtype: the conv + SiLU of each row (x [T, C]; conv_state [S, K, C] the pool of rings, row
    r of a ring holding its sequence's input at the latest position = r mod K; weight [C, 1, K]; seq [T] each
    row's sequence, B for padding (read as sequence B - 1, whose outputs are then unused); starts [B] each
    sequence's first row; slots [B]; positions [T])."""
    T, C = x.shape
    K = weight.shape[-1]
    B = slots.shape[0]
    ring = conv_state[slots]  # [B, K, C]
    b = jnp.minimum(seq, B - 1)
    rows = jnp.arange(T)
    r = rows - starts[b]  # offset of each row within its sequence's new tokens
    w = weight[:, 0, :].astype(jnp.float32)  # [C, K]
    acc = jnp.zeros((T, C), jnp.float32)
    for d in range(K):  # tap d looks d positions back: in this step's rows, else in the ring
        p = positions - d
        from_x = x[jnp.maximum(rows - d, 0)]
        from_ring = jnp.where((p >= 0)[:, None], ring[b, p % K], 0)
        tap = jnp.where((r >= d)[:, None], from_x, from_ring)
        acc = acc + tap.astype(jnp.float32) * w[:, K - 1 - d]
    return jax.nn.silu(acc).astype(x.dtype)


def causal_conv_reference(x: jax.Array, conv_state: jax.Array, weight: jax.Array, seq: jax.Array, starts: jax.Array,
                          query_start: jax.Array, slots: jax.Array, positions: jax.Array,
                          write_slots: jax.Array | None = None, keep: jax.Array | None = None
                          ) -> tuple[jax.Array, jax.Array]:
    """The whole conv step in jnp: (y [T, C], the pool with each sequence's newest inputs written to its ring)
    for the first C = weight.shape[0] columns of x [T, >= C] (`conv_reference`, then `ring_update`). The ring
    has one row more than the conv reads, so that the decode kernel (gated_delta_rule_decode.py) writes a step's
    row where no program of the step reads; inputs before position 0 are zeros, whatever the ring holds."""
    x = x[:, :weight.shape[0]]
    return (conv_reference(x, conv_state, weight, seq, starts, slots, positions),
            ring_update(x, conv_state, slots, query_start, positions, write_slots, keep))


def ring_update(x: jax.Array, conv_state: jax.Array, slots: jax.Array, query_start: jax.Array,
                positions: jax.Array, write_slots: jax.Array | None = None, keep: jax.Array | None = None
                ) -> jax.Array:
    """The pool with each sequence's newest inputs written to its ring: ring row r takes the sequence's latest
    new input at a position = r mod K, if this step has one (else it keeps what it held). write_slots (None:
    `slots`): where each sequence's updated ring goes (read from slots[b]). keep (None: none): where keep[b] > 0
    (and write_slots[b] != slots[b]), slots[b] takes the ring after the sequence's first keep[b] new rows (a row
    verifying drafts keeps the ring after its known tokens)."""
    ring = conv_state[slots]  # [B, K, C]
    n = query_start[1:] - query_start[:-1]  # [B]
    writes = slots if write_slots is None else write_slots
    # unique_indices: a running sequence's slots are its own; padding sequences (and the kept rings' writes of the
    # sequences keeping none) go to the scratch slot 0, whose contents no sequence reads. Without it XLA's GPU scatter
    # writes each element by an atomic compare-and-swap loop (86 us a layer for 256 rings of 4 x 8192 bf16 in an
    # H100 profile of offline serving).
    if keep is None:
        return conv_state.at[writes].set(_ring_after(x, ring, query_start, positions, n).astype(conv_state.dtype),
                                         unique_indices=True)
    rings = jnp.concatenate([_ring_after(x, ring, query_start, positions, jnp.minimum(keep, n)),
                             _ring_after(x, ring, query_start, positions, n)])  # (one scatter for both)
    return conv_state.at[jnp.concatenate([jnp.where(keep > 0, slots, 0), writes])].set(
        rings.astype(conv_state.dtype), unique_indices=True)


def _ring_after(x: jax.Array, ring: jax.Array, query_start: jax.Array, positions: jax.Array, count: jax.Array
                ) -> jax.Array:
    """[B, K, C]: each sequence's ring (`ring`, as read) after its first count[b] new rows (0: unchanged)."""
    T, K = x.shape[0], ring.shape[1]
    last = positions[jnp.clip(query_start[:-1] + count - 1, 0, T - 1)]  # [B] the position of the last row counted
    latest = last[:, None] - (last[:, None] - jnp.arange(K)[None, :]) % K  # [B, K]
    off = latest - (last - count + 1)[:, None]  # offset within the sequence's rows counted (< 0: not among them)
    return jnp.where((off >= 0)[..., None], x[jnp.clip(query_start[:-1, None] + off, 0, T - 1)], ring)


def _conv_kernel(x_ref, cs_ref, w_ref, seq_ref, starts_ref, slots_ref, pos_ref, y_ref, *, taps: int, block_t: int,
                 block_c: int):
    # x_ref [T, W]: the inputs in its columns [0, C) (read in place, e.g. a projection's first C columns);
    # cs_ref [S, K, C]; w_ref [C, K]; seq_ref, pos_ref [T]; starts_ref, slots_ref [B]; y_ref [T, C]
    T = x_ref.shape[0]
    B = slots_ref.shape[0]
    t0, c0 = pl.program_id(0) * block_t, pl.program_id(1) * block_c
    rows = t0 + jnp.arange(block_t, dtype=jnp.int32)  # [bt]
    valid = rows < T
    rows_in = jnp.minimum(rows, T - 1)
    b = jnp.minimum(seq_ref[rows_in], B - 1)  # [bt]
    r = rows - starts_ref[b]
    slot, pos = slots_ref[b], pos_ref[rows_in]
    cols = c0 + jnp.arange(block_c, dtype=jnp.int32)  # [bc]
    acc = jnp.zeros((block_t, block_c), jnp.float32)
    for d in range(taps):
        p = pos - d
        from_x = x_ref[jnp.maximum(rows_in - d, 0)[:, None], cols[None, :]]
        if d:  # rows whose tap d reaches before this step's rows: from the ring (zeros before position 0)
            ring = ((r < d) & (p >= 0) & valid)[:, None]
            from_ring = plgpu.load(cs_ref.at[slot[:, None], jax.lax.rem(p + taps, taps)[:, None], cols[None, :]],
                                   mask=jnp.broadcast_to(ring, (block_t, block_c)), other=0.0)
            from_x = jnp.where((r >= d)[:, None], from_x, from_ring)
        acc = acc + from_x.astype(jnp.float32) * w_ref[cols, taps - 1 - d].astype(jnp.float32)[None, :]
    y = (acc * jax.nn.sigmoid(acc)).astype(y_ref.dtype)
    plgpu.store(y_ref.at[rows[:, None], cols[None, :]], y, mask=jnp.broadcast_to(valid[:, None], y.shape))


@functools.partial(jax.jit, static_argnames=("block_t", "block_c", "num_warps", "interpret"))
def causal_conv(x: jax.Array, conv_state: jax.Array, weight: jax.Array, seq: jax.Array, starts: jax.Array,
                slots: jax.Array, positions: jax.Array, *, block_t: int = 16, block_c: int = 128,
                num_warps: int = 4, interpret: bool = False) -> jax.Array:
    """`conv_reference` in one kernel (module doc): y [T, C] in x's dtype, for the first C = weight.shape[0]
    columns of x [T, W >= C] (read in place: a slice of a wider array would be copied out first). C a multiple of
    block_c (a power of two), K >= 1 taps. The default blocks and warps were the fastest of a sweep at Qwen3.5-4B's
    8192 channels (H100, gdn_conv_h100_d3496cc.json: 147 us for 8k rows, XLA's form 204 us)."""
    T, C, K = x.shape[0], weight.shape[0], weight.shape[-1]
    if conv_state.shape[1:] != (K, C) or weight.shape != (C, 1, K) or x.shape[1] < C:
        raise ValueError(f"conv_state [S, K, C] and weight [C, 1, K] for x [T, W >= C]: {x.shape=} "
                         f"{conv_state.shape=} {weight.shape=}")
    block_c = min(block_c, C)
    if C % block_c or block_c & (block_c - 1) or block_t & (block_t - 1):
        raise ValueError(f"C={C} must be a multiple of block_c={block_c}, both blocks powers of two ({block_t=})")
    whole = pl.no_block_spec
    kernel = functools.partial(_conv_kernel, taps=K, block_t=block_t, block_c=block_c)
    # a ring's row r holds position = r mod K; the kernel reads row (p + K) rem K for p >= 0, which is p mod K
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(T, block_t), C // block_c),
        in_specs=[whole] * 7,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((T, C), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="causal_conv",
    )(x, conv_state, weight[:, 0, :], seq.astype(jnp.int32), starts.astype(jnp.int32), slots.astype(jnp.int32),
      positions.astype(jnp.int32))
