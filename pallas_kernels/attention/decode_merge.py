"""The paged decode kernel's split-K epilogue (flash-decoding): each split's unnormalised fp32 partial and its running
max / sum, merged into the attention output, as one small Pallas kernel (XLA's merge is ~5 kernels of ~1.3 us launch
latency each at decode) or as XLA's fusions of the same math (`merge_splits_reference`).

Partials are `[S, B, KVH, Gp, D]` (and `[S, B, KVH, Gp]`): a program's rows of paged_attention.py, one query token's G
query heads of the kv head (decode steps), or with `query_len` Q > 1 row r = token r // G's head r % G of the
sequence's Q tokens (verify steps), whose outputs go to their ragged token rows.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py` for why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2

# The merge kernel holds every split of one row in registers: [splits, head_dim] float32.
MERGE_KERNEL_MAX_SPLITS = 64


def merge_splits_reference(acc, m, l, group: int) -> jax.Array:
    """The splits' partial softmaxes ([S, B, KVH, Gp, D] unnormalised, running max in log2 units and sum
    [S, B, KVH, Gp]) merged: [B, KVH, group, D] float32 (zeros where every split was empty)."""
    m_max = m.max(axis=0)
    w = jnp.exp2(m - m_max[None])  # [S, B, KVH, Gp]
    l_tot = (w * l).sum(axis=0)
    acc = (w[..., None] * acc).sum(axis=0)
    return (acc / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None])[:, :, :group]


def _merge_row(acc_ref, m_ref, l_ref, b, h, r, splits: int) -> jax.Array:
    """Row r of (sequence b, kv head h) merged over its splits: [D] float32. The splits are loaded at once
    (independent loads, no serial chain)."""
    padded = next_pow2(splits)
    valid = jnp.arange(padded, dtype=jnp.int32) < splits
    s = pl.ds(0, padded)
    m = plgpu.load(m_ref.at[s, b, h, r], mask=valid, other=jnp.finfo(jnp.float32).min)  # [S]
    l = plgpu.load(l_ref.at[s, b, h, r], mask=valid, other=0.0)
    acc = plgpu.load(acc_ref.at[s, b, h, r, :], mask=valid[:, None], other=0.0)  # [S, D]
    w = jnp.exp2(m - jnp.max(m))
    l_tot = jnp.sum(w * l)
    return jnp.sum(w[:, None] * acc, axis=0) / jnp.where(l_tot == 0.0, 1.0, l_tot)


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, splits: int, kv_heads_fastest: bool):
    """One program per (kv head, sequence, query head of the group): o_ref [D], that head's row."""
    h, b = (pl.program_id(0), pl.program_id(1)) if kv_heads_fastest else (pl.program_id(1), pl.program_id(0))
    o_ref[...] = _merge_row(acc_ref, m_ref, l_ref, b, h, pl.program_id(2), splits).astype(o_ref.dtype)


def _merge_rows_kernel(acc_ref, m_ref, l_ref, qs_ref, _, o_ref, *, splits: int, kv_heads_fastest: bool, group: int,
                       num_heads: int):
    """query_len > 1: one program per (kv head, sequence, row r of the Q x G): token r // G of the sequence (if it has
    that many), query head h * G + r % G. qs_ref [B + 1] query_start; o_ref [T * H, D] (aliased to the input `_`, whose
    padding rows the attention kernel zeroed)."""
    h, b = (pl.program_id(0), pl.program_id(1)) if kv_heads_fastest else (pl.program_id(1), pl.program_id(0))
    r = pl.program_id(2)
    q0 = qs_ref[b]
    j = r // group

    @pl.when(j < qs_ref[b + 1] - q0)
    def _():
        row = (q0 + j) * num_heads + h * group + r % group
        o_ref[pl.ds(row, 1), :] = _merge_row(acc_ref, m_ref, l_ref, b, h, r, splits)[None].astype(o_ref.dtype)


def merge_call(acc, m, l, *, num_heads, group, dtype, kv_heads_fastest, interpret, query_len: int = 1,
               query_start=None, out=None):
    """The merge kernel: [B, KVH, group, D] in `dtype` (decode), or with query_len Q > 1 the ragged rows of `out`
    [T * H, D] (written in place) for each sequence's tokens (`query_start` [B + 1], at most Q each)."""
    splits, batch, num_kv_heads, _, head_dim = acc.shape
    rows = group if query_len == 1 else query_len * group
    grid = (num_kv_heads, batch, rows) if kv_heads_fastest else (batch, num_kv_heads, rows)
    common = dict(grid=grid, compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
                  name=f"paged_decode_merge_s{splits}" + (f"_q{query_len}" if query_len > 1 else ""))
    if query_len > 1:
        kernel = functools.partial(_merge_rows_kernel, splits=splits, kv_heads_fastest=kv_heads_fastest, group=group,
                                   num_heads=num_heads)
        return pl.pallas_call(kernel, in_specs=[pl.no_block_spec] * 5, out_specs=pl.no_block_spec,
                              out_shape=jax.ShapeDtypeStruct(out.shape, out.dtype), input_output_aliases={4: 0},
                              **common)(acc, m, l, query_start, out)
    kernel = functools.partial(_merge_kernel, splits=splits, kv_heads_fastest=kv_heads_fastest)
    out_map = (lambda h, b, g: (b, h, g, 0)) if kv_heads_fastest else (lambda b, h, g: (b, h, g, 0))
    return pl.pallas_call(kernel, in_specs=[pl.no_block_spec] * 3,
                          out_specs=pl.BlockSpec((None, None, None, head_dim), out_map),
                          out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, group, head_dim), dtype),
                          **common)(acc, m, l)
