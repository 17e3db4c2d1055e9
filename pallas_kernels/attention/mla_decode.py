"""Paged MLA decode attention: DeepSeek's multi-head latent attention in the weight-absorbed form, one new query token
per sequence against its paged latent cache.

Cache: `latent [num_pages, page_size, L]`, L = kv_lora_rank R + rope_dim P (576 = 512 + 64 for DeepSeek-V2/V3): per
token the latent c (R values: the keys' no-RoPE part and the values at once) and the RoPE key k_pe (P values) that every
head shares. Sequence b's token t lives in page `page_table[b, t // page_size]`, row `t % page_size`.
Query `q [B, H, L]`: per head q_nope through W_UK (the query in the latent space, R values), then q_pe (P values).
Head h: score[t] = q[h] . row[t] (= q_latent . c + q_pe . k_pe), out[h] = softmax(scale * score) @ c, `[H, R]`; W_UV
and the o projection stay outside.

Work split. Every head reads every row, so a program takes a block of heads as the M dimension of its dots (16 rows,
the smallest tensor-core tile; 32 for 128 heads) and loads each block of `block_n` rows once for all of them: one
gathered tile `[block_n, R]` of c feeds the score dot and then the value dot (FlashMLA shares K and V in shared memory
alike; the Triton MLA decode kernels of vLLM / sglang load the V tile a second time), a `[block_n, P]` tile of k_pe the
RoPE term. Rows are gathered one per token through the page table, the load form that took the paged decode kernel
from 2.2 to 2.8 TB/s (paged_attention.py). A program is (head block, sequence, split), head blocks fastest so programs
reading the same pages run side by side and the second read hits L2. With too few programs to fill the GPU (16 heads,
DeepSeek-V2-Lite or V3 at tp = 8: one head block per sequence) each sequence's own blocks are split (flash-decoding):
every split stores an unnormalised fp32 partial with its running max / sum, and a merge kernel combines them.
(FlashMLA instead balances (sequence, block) work over a fixed count of SM parts from a metadata pass; a split count
per step is what the paged decode kernel measured well enough.)

One query token per sequence, as paged_decode_attention: speculative verification (k + 1 rows per sequence) takes the
ragged path, as the other families' verifying steps do.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`). Launch defaults from the H100 sweep
(`bench_attention mla_decode --sweep`, batch 32 x 4k, `mla_decode_h100.json`): 64 tokens a step in 3 stages, 73.8 us
(2.05 TB/s) at 16 heads and 294 us (0.51 TB/s) at 128 heads, against 86.2 / 482 us with vLLM's Triton defaults (32
tokens, 2 stages). At 128 heads the kernel is bound by its dots, not by bytes: 36 GFLOP a call on mma.sync tiles of
16-32 rows (a 64-row tile's [64, 512] fp32 accumulator spills: 448-842 us); FlashMLA's answer is wgmma over 64 heads
with the value columns split between two warpgroups (a Mosaic GPU kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import LOG2E, MASK_VALUE, next_pow2, pow2_divisor

MIN_ROWS = 16  # tensor-core dots want M, N and K >= 16
TARGET_PROGRAMS = 264  # ~2 waves of the H100's 132 SMs, used to pick num_splits (as paged_attention.py)
ONE_SPLIT_PROGRAMS = 192  # head blocks x batch from which one split fills the GPU (no partials, no merge)
MAX_SPLITS = 64  # partials cost 2 x splits x [H, R] fp32 per sequence; more splits than this buy nothing
BLOCK_N = 64  # tokens per inner step: a 72 KB [64, 576] bf16 stage
NUM_STAGES = 3
MERGE_COLS = 128  # columns of R per merge program: [splits <= 64, 128] fp32 in registers


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _cols(ref, rows: jax.Array, start: int, width: int, padded: int) -> jax.Array:
    """`ref[rows, start:start + width]` as `[len(rows), padded]`, zeros past `width`. A power-of-two width of >= 16
    is one strided slice (contiguous, vectorised loads); a narrower or odd one (a small model's RoPE key) gathers
    clipped column indices, since a slice may not run past the array."""
    if width == padded:
        return ref[rows, pl.ds(start, width)]
    col = jnp.arange(padded, dtype=jnp.int32)
    vals = ref[rows[:, None], jnp.minimum(start + col, start + width - 1)[None, :]]
    return jnp.where((col < width)[None, :], vals, jnp.zeros_like(vals))


def _mla_decode_kernel(
    q_ref,  # [B * H, L]: every query row (a sequence's heads contiguous)
    lat_ref,  # [num_pages * page_size, L]: the whole latent cache, one row per token
    pt_ref,  # [Pp]: this sequence's page ids (padded to whole blocks of block_n tokens)
    len_ref,  # [1]: this sequence's context length
    o_ref,  # one split: [B * H, R] (rows as q_ref). split-K: [rows, R] unnormalised fp32 partial
    *ml_refs,  # split-K: m_ref [rows], l_ref [rows] fp32 (running max in log2 units, sum)
    scale: float,
    rank: int,
    rope: int,
    rope_padded: int,
    num_heads: int,
    group: int,
    rows: int,
    block_n: int,
    page_size: int,
    splits: int,
):
    hb, b, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq_len = len_ref[0]
    # The splits share this sequence's own blocks, not the table's width (max_model_len), as paged_attention.py.
    seq_blocks = jnp.minimum(pl.cdiv(seq_len, block_n), pt_ref.shape[0] * page_size // block_n)
    per_split = pl.cdiv(seq_blocks, splits)
    first_block = split * per_split
    n_blocks = jnp.clip(seq_blocks - first_block, 0, per_split)

    # The block's `group` heads, padded to `rows`: padding rows read a clipped (real) row, are zeroed and never stored.
    head = jnp.arange(rows, dtype=jnp.int32)
    real = (head < group)[:, None]  # [rows, 1]
    first_row = b * num_heads + hb * group
    q_rows = jnp.minimum(first_row + head, q_ref.shape[0] - 1)  # [rows]
    dtype = lat_ref.dtype  # dots in the cache's dtype (q may be wider)
    q_nope = jnp.where(real, q_ref[q_rows, pl.ds(0, rank)], 0).astype(dtype)  # [rows, R]
    q_pe = jnp.where(real, _cols(q_ref, q_rows, rank, rope, rope_padded), 0).astype(dtype)  # [rows, Pp]
    qk_scale = scale * LOG2E  # softmax in base 2: exp2 is one instruction

    def body(i, carry):
        acc, m_prev, l_prev = carry  # [rows, R], [rows], [rows] fp32
        tok = (first_block + i) * block_n + jnp.arange(block_n, dtype=jnp.int32)  # [block_n] positions
        kv_rows = pt_ref[tok // page_size] * page_size + tok % page_size  # [block_n] rows of lat_ref
        c = lat_ref[kv_rows, pl.ds(0, rank)]  # [block_n, R]: keys (no-RoPE part) and values, loaded once
        k_pe = _cols(lat_ref, kv_rows, rank, rope, rope_padded)  # [block_n, Pp]
        s = plgpu.dot(q_nope, c, trans_b=True) + plgpu.dot(q_pe, k_pe, trans_b=True)  # [rows, block_n] fp32
        s = jnp.where((tok < seq_len)[None, :], s * qk_scale, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # [rows]
        alpha = jnp.exp2(m_prev - m_next)  # [rows]
        p = jnp.exp2(s - m_next[:, None])  # [rows, block_n]
        l_next = alpha * l_prev + p.sum(axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(dtype), c)  # [rows, R]
        return acc, m_next, l_next

    acc = jnp.zeros((rows, rank), jnp.float32)
    m = jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, (acc, m, l))

    if ml_refs:
        m_ref, l_ref = ml_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        l_safe = jnp.where(l == 0.0, 1.0, l)  # seq_len 0 (padding) -> zeros, not NaN
        out = (acc / l_safe[:, None]).astype(o_ref.dtype)
        plgpu.store(o_ref.at[pl.ds(first_row, rows)], out, mask=jnp.broadcast_to(real, (rows, rank)))


def _merge_kernel(
    acc_ref,  # [S, B, HB, rows, R] fp32 partials
    m_ref,  # [S, B, HB, rows] running max (log2 units)
    l_ref,  # [S, B, HB, rows] sum
    o_ref,  # [cols]: this (sequence, head, column chunk)'s output
    *,
    splits: int,
    cols: int,
):
    """One program per (head block, sequence, head, column chunk): that row's splits loaded at once and merged."""
    hb, b, g, c = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)
    padded = next_pow2(splits)
    valid = jnp.arange(padded, dtype=jnp.int32) < splits  # [S_pad]
    s = pl.ds(0, padded)
    m = plgpu.load(m_ref.at[s, b, hb, g], mask=valid, other=jnp.finfo(jnp.float32).min)  # [S_pad]
    l = plgpu.load(l_ref.at[s, b, hb, g], mask=valid, other=0.0)  # [S_pad]
    acc = plgpu.load(acc_ref.at[s, b, hb, g, pl.ds(c * cols, cols)], mask=valid[:, None], other=0.0)  # [S_pad, cols]
    w = jnp.exp2(m - jnp.max(m))  # empty splits (m = finfo.min) weigh 0
    l_tot = jnp.sum(w * l)
    out = jnp.sum(w[:, None] * acc, axis=0) / jnp.where(l_tot == 0.0, 1.0, l_tot)
    o_ref[...] = out.astype(o_ref.dtype)


# ----------------------------------------------------------------------------------------------
# Wrapper: grid and block specs
# ----------------------------------------------------------------------------------------------
def plan_heads(num_heads: int, block_h: int | None = None) -> tuple[int, int]:
    """(group, rows): heads per program and the tile rows they pad to. All heads in one program up to `block_h`
    (default 16, or 32 above 16 heads: 128 heads then read each row 4 times, 3 of them meant to hit L2, and the
    [32, 512] fp32 accumulator is 64 registers a thread over 8 warps), else the largest power of two <= block_h
    dividing them."""
    block_h = block_h or (MIN_ROWS if num_heads <= MIN_ROWS else 2 * MIN_ROWS)
    group = num_heads if num_heads <= block_h else pow2_divisor(num_heads, block_h)
    return group, max(MIN_ROWS, next_pow2(group))


def plan_splits(programs: int, num_blocks: int, num_splits: int | None,
                target_programs: int = TARGET_PROGRAMS) -> int:
    """Split-K factor for `programs` = head blocks x batch: none once ONE_SPLIT_PROGRAMS fill the GPU, else enough
    for `target_programs`, at most MAX_SPLITS and one split per block of the table."""
    if num_splits is None:
        num_splits = 1 if programs >= ONE_SPLIT_PROGRAMS else min(MAX_SPLITS, pl.cdiv(target_programs, programs))
    return max(1, min(num_splits, num_blocks))


def _mla_call(q, latent, page_table, seq_lens, *, rank, scale, block_h, block_n, num_splits, num_warps, num_stages,
              target_programs, interpret):
    batch, num_heads, dim = q.shape
    page_size = latent.shape[1]
    rope = dim - rank
    group, rows = plan_heads(num_heads, block_h)
    head_blocks = num_heads // group
    max_pages = page_table.shape[1]
    block_n = max(MIN_ROWS, min(block_n or BLOCK_N, next_pow2(max_pages * page_size)))
    num_blocks = pl.cdiv(max_pages * page_size, block_n)
    padded_pages = pl.cdiv(num_blocks * block_n, page_size)
    splits = plan_splits(batch * head_blocks, num_blocks, num_splits, target_programs)
    num_warps = num_warps or (4 if rows <= MIN_ROWS else 8)  # 8 warps keep a [32, 512] fp32 accumulator in registers

    q2 = q.reshape(batch * num_heads, dim)  # [B * H, L], a free reshape
    rows_view = latent.reshape(-1, dim)  # [num_pages * page_size, L], a free reshape
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, max(0, padded_pages - max_pages))))  # [B, Pp]
    lens = seq_lens.astype(jnp.int32).reshape(batch, 1)  # [B, 1]

    kernel = functools.partial(_mla_decode_kernel, scale=scale, rank=rank, rope=rope,
                               rope_padded=max(MIN_ROWS, next_pow2(rope)), num_heads=num_heads, group=group,
                               rows=rows, block_n=block_n, page_size=page_size, splits=splits)
    grid = (head_blocks, batch, splits)  # head blocks fastest: a sequence's pages read side by side
    whole = pl.no_block_spec  # q, the cache (rows gathered in the kernel) and the one-split output
    in_specs = [
        whole,
        whole,
        pl.BlockSpec((None, table.shape[1]), lambda h, b, s: (b, 0)),
        pl.BlockSpec((None, 1), lambda h, b, s: (b, 0)),
    ]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((batch * num_heads, rank), q.dtype)
        out_specs = whole
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, batch, head_blocks, rows, rank), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, head_blocks, rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, head_blocks, rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, rank), lambda h, b, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, rows), lambda h, b, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, rows), lambda h, b, s: (s, b, h, 0)),
        ]
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages or NUM_STAGES),
        interpret=interpret,
        name=f"mla_decode_attention_h{rows}_n{block_n}_s{splits}",
    )(q2, rows_view, table, lens)
    if splits > 1:
        out = _merge_call(*out, group=group, dtype=q.dtype, interpret=interpret)  # [B, HB, group, R]
    return out.reshape(batch, num_heads, rank)


def _merge_call(acc, m, l, *, group, dtype, interpret):
    splits, batch, head_blocks, _, rank = acc.shape
    cols = min(rank, MERGE_COLS)
    out = pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits, cols=cols),
        grid=(head_blocks, batch, group, rank // cols),
        in_specs=[pl.no_block_spec] * 3,
        out_specs=pl.BlockSpec((None, None, None, cols), lambda h, b, g, c: (b, h, g, c)),
        out_shape=jax.ShapeDtypeStruct((batch, head_blocks, group, rank), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"mla_decode_merge_s{splits}",
    )(acc, m, l)
    return out


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def check_supported(q: jax.Array, latent: jax.Array, kv_lora_rank: int) -> str | None:
    """Why the kernel cannot take these shapes (callers fall back to the reference), or None."""
    if q.ndim != 3 or latent.ndim != 3 or q.shape[2] != latent.shape[2]:
        return f"q must be [batch, heads, L] and latent [pages, page_size, L]: {q.shape=} {latent.shape=}"
    rank, page_size = kv_lora_rank, latent.shape[1]
    if not 0 < rank < q.shape[2]:
        return f"kv_lora_rank must be in (0, L): {kv_lora_rank=} {q.shape=}"
    if rank < MIN_ROWS or rank & (rank - 1) or page_size & (page_size - 1):
        return f"kv_lora_rank (>= {MIN_ROWS}) and page_size must be powers of two: {kv_lora_rank=} {page_size=}"
    if latent.size >= 2**31:  # the gathers' element offsets (row * L + column) are int32
        return f"the latent cache must hold < 2**31 values per layer, got {latent.shape=}"
    return None


def _check_args(q, latent, page_table, seq_lens, kv_lora_rank, block_h, block_n, num_splits):
    reason = check_supported(q, latent, kv_lora_rank)
    if reason is not None:
        raise ValueError(reason)
    batch = q.shape[0]
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be [batch, pages_per_seq]: {page_table.shape=} {q.shape=}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [batch]: {seq_lens.shape=} {q.shape=}")
    for name, n in (("block_h", block_h), ("block_n", block_n)):
        if n is not None and (n < 1 or n & (n - 1)):
            raise ValueError(f"{name} must be a power of two >= 1 or None, got {n}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits=}")


@functools.partial(jax.jit, static_argnames=(
    "kv_lora_rank", "scale", "block_h", "block_n", "num_splits", "num_warps", "num_stages", "target_programs",
    "interpret"))
def mla_decode_attention(
    q: jax.Array,
    latent: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    *,
    kv_lora_rank: int,
    scale: float,
    block_h: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    target_programs: int = TARGET_PROGRAMS,
    interpret: bool = False,
) -> jax.Array:
    """Absorbed-form MLA decode attention of one query token per sequence over a paged latent cache.

    Args:
      q: `[batch, num_heads, L]`: per head the query in the latent space (`kv_lora_rank` values, q_nope through
        W_UK) then its RoPE part, for each sequence's newest token (position `seq_lens[b] - 1`).
      latent: `[num_pages, page_size, L]`, rows `[c | k_pe]`; the new token's row already written.
      page_table: int32 `[batch, pages_per_seq]`; unused entries must be valid page ids (e.g. 0).
      seq_lens: int32 `[batch]`, context length including the new token; 0 marks a padding sequence (zeros out).
      kv_lora_rank: R, the latent's width (a power of two >= 16); the RoPE part is the remaining L - R (any width).
      scale: softmax scale (DeepSeek: (qk_nope + qk_rope) ** -0.5 times YaRN's mscale squared).
      block_h: heads per program (power of two); default 16, 32 above 16 heads (`plan_heads`).
      block_n: tokens per inner step (power of two, >= 16 used); default BLOCK_N.
      num_splits: flash-decoding splits of each context; None fills the GPU (`plan_splits`).
      num_warps, num_stages: Triton launch parameters (None: 4 warps for 16-row tiles, 8 above; NUM_STAGES).
      target_programs: the programs split-K aims for.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[batch, num_heads, kv_lora_rank]` in q's dtype (softmax and accumulation in fp32): the softmax-weighted latent,
      for W_UV.
    """
    _check_args(q, latent, page_table, seq_lens, kv_lora_rank, block_h, block_n, num_splits)
    return _mla_call(q, latent, page_table, seq_lens, rank=kv_lora_rank, scale=scale, block_h=block_h,
                     block_n=block_n, num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                     target_programs=target_programs, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "scale"))
def mla_decode_attention_reference(q: jax.Array, latent: jax.Array, page_table: jax.Array, seq_lens: jax.Array, *,
                                   kv_lora_rank: int, scale: float) -> jax.Array:
    """Pure-jnp MLA decode attention in float32 (gathers every page of the table); same contract as the kernel."""
    batch, _, dim = q.shape
    ctx = page_table.shape[1] * latent.shape[1]
    rows = latent[page_table].reshape(batch, ctx, dim).astype(jnp.float32)  # [B, S, L]
    s = jnp.einsum("bhl,bsl->bhs", q.astype(jnp.float32), rows) * scale  # [B, H, S]
    valid = jnp.arange(ctx)[None, :] < seq_lens[:, None]  # [B, S]
    s = jnp.where(valid[:, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("bhs,bsr->bhr", p, rows[..., :kv_lora_rank]) / jnp.where(l == 0.0, 1.0, l)
    return o.astype(q.dtype)
