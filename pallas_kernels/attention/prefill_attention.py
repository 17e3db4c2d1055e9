"""Ragged (chunked) prefill attention over a paged KV cache.

The batch is flattened: sequence b owns query tokens `q[query_start[b]:query_start[b+1]]`, which are
the LAST tokens of its context of `seq_lens[b]` tokens (their K/V already in the cache). The token at
position p attends causally to positions 0..p of its own sequence. Decodes (one new token) and
prefill chunks mix freely.

Work is cut into tiles of `block_q` consecutive tokens of one sequence; tile -> (sequence, token
range) is a small int32 table built on device in the wrapper, so the grid is static
(`cdiv(T, block_q) + B + 1` tiles, the extra ones exit at once). Tokens after `query_start[B]`
(bucket padding) form one more pseudo-sequence with no context, so their output is zeros.
One program = (tile, kv head): its block_q tokens x G query heads form a `[block_q * G, D]` matrix
against the kv head's pages (GQA: each K/V byte read once per tile). Blocks fully below the tile's
first position run unmasked; only the diagonal blocks apply the causal mask.

FP8 cache (float8_e4m3fn pages with a float32 scale per kv head): as in the decode kernel, K and V are converted to
q's dtype as they are loaded, K's scale folded into the softmax's and V's applied to the accumulator.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.paged_attention import row_view, token_rows
from pallas_kernels.common import LOG2E, MASK_VALUE, next_pow2, search_right
from pallas_kernels.kv_fp8 import check_kv_scales, dequantize_kv, is_fp8

# columns of the per-tile table
_Q0, _Q1, _WIN, _SHIFT, _SEQ, _CTX = range(6)


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _prefill_kernel(
    tile_ref,  # [8] int32: q0, q1 (valid tokens), window start, position shift, seq, ctx len
    q_ref,  # [T, Gp, D]: every token's query heads of this kv head
    k_ref,  # [num_pages * page_size, D]: this kv head's rows of the K cache (`paged_attention.row_view`)
    v_ref,  # [num_pages * page_size, D]
    pt_ref,  # [(B + 1) * Pp]: page table, flat (last row: the padding pseudo-sequence)
    *refs,  # [ks_ref, vs_ref [1] fp32: FP8 scales,] [prev_ref [T, Gp, D] (aliased to o_ref: rows this call does not
    # compute keep it),] o_ref [T, Gp, D]
    scale: float,
    block_q: int,
    pages_per_block: int,
    page_size: int,
    table_width: int,
    fp8: bool,
):
    o_ref = refs[-1]
    _, group, head_dim = q_ref.shape
    block_k = pages_per_block * page_size
    rows = block_q * group
    q0, q1, win = tile_ref[_Q0], tile_ref[_Q1], tile_ref[_WIN]
    shift, seq = tile_ref[_SHIFT], tile_ref[_SEQ]

    @pl.when(q1 > q0)
    def _():
        # The window [win, win + block_q) is clamped inside [0, T); only rows in [q0, q1) are ours.
        q = q_ref[pl.ds(win, block_q)].reshape(rows, head_dim)  # [rows, D], row = token * G + head
        tok = win + jnp.arange(rows, dtype=jnp.int32) // group  # [rows]
        row_pos = tok + shift  # [rows] position of each row's token in its sequence
        first_pos = q0 + shift
        last_pos = q1 - 1 + shift
        n_full = jnp.maximum(first_pos + 1, 0) // block_k  # blocks visible to every valid row
        n_blocks = jnp.maximum(pl.cdiv(last_pos + 1, block_k), 0)
        qk_scale = scale * LOG2E
        if fp8:
            qk_scale = qk_scale * refs[0][0]

        def make_body(masked: bool):
            def body(j, carry):
                acc, m_prev, l_prev = carry  # [rows, D], [rows], [rows] fp32
                first = seq * table_width + j * pages_per_block  # the flat table's slot of this block's first page
                kv_rows = token_rows(pt_ref, first, block_k, page_size)  # [block_k]
                k = k_ref[kv_rows]  # [block_k, D]: one row per token, straight into the dots (pipelined)
                v = v_ref[kv_rows]
                if fp8:  # e4m3 -> q's dtype is exact; the scales are applied outside the loop
                    k, v = k.astype(q.dtype), v.astype(q.dtype)
                s = plgpu.dot(q, k, trans_b=True) * qk_scale  # [rows, block_k] fp32
                if masked:
                    kv_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
                    s = jnp.where(kv_pos[None, :] <= row_pos[:, None], s, MASK_VALUE)
                m_next = jnp.maximum(m_prev, s.max(axis=1))
                alpha = jnp.exp2(m_prev - m_next)
                p = jnp.exp2(s - m_next[:, None])  # [rows, block_k]
                l_next = alpha * l_prev + p.sum(axis=1)
                acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)
                return acc, m_next, l_next

            return body

        acc = jnp.zeros((rows, head_dim), jnp.float32)
        m = jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32)
        l = jnp.zeros((rows,), jnp.float32)
        carry = jax.lax.fori_loop(0, n_full, make_body(False), (acc, m, l))
        acc, m, l = jax.lax.fori_loop(n_full, n_blocks, make_body(True), carry)
        if fp8:
            acc = acc * refs[1][0]
        l = jnp.where(l == 0.0, 1.0, l)  # rows without context (padding) -> zeros
        out = (acc / l[:, None]).astype(o_ref.dtype).reshape(block_q, group, head_dim)
        mine = (tok >= q0) & (tok < q1)  # [rows]
        mask = jnp.broadcast_to(mine.reshape(block_q, group, 1), (block_q, group, head_dim))
        plgpu.store(o_ref.at[pl.ds(win, block_q)], out, mask=mask)


# ----------------------------------------------------------------------------------------------
# Wrapper: tile table, grid and block specs
# ----------------------------------------------------------------------------------------------
def _tile_table(query_start, seq_lens, num_tokens: int, block_q: int, num_tiles: int, seg_mask=None,
                window: int | None = None, align: int = 1):
    """[num_tiles, 8] int32: per tile q0, q1, window start, position shift, seq, ctx (rest 0).

    Tiles hold up to block_q tokens (up to `window` for segments starting at a multiple of `align`);
    each tile's window of `window` (default block_q) tokens starts at a multiple of `align`, inside
    [0, num_tokens), and covers the tile's tokens (needs window >= block_q + align - 1 and
    num_tokens a multiple of align).
    seg_mask: optional bool [B + 1] (segment B: the padding tokens); False segments get no tiles.
    """
    window = window or block_q
    batch = seq_lens.shape[0]
    qs = query_start.astype(jnp.int32)
    starts = qs  # [B+1]: segment b = sequence b; segment B = trailing padding tokens
    ends = jnp.concatenate([qs[1:], jnp.array([num_tokens], jnp.int32)])
    ctx = jnp.concatenate([seq_lens.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])
    qlen = jnp.maximum(ends - starts, 0)
    block = jnp.where(starts % align == 0, window, block_q)  # [B+1] tokens per tile
    tiles = pl.cdiv(qlen, block)  # [B+1]
    if seg_mask is not None:
        tiles = jnp.where(seg_mask, tiles, 0)
    cum = jnp.cumsum(tiles)
    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seg = jnp.minimum(search_right(cum, i), batch).astype(jnp.int32)
    live = i < cum[-1]
    j = i - (cum[seg] - tiles[seg])
    q0 = jnp.where(live, starts[seg] + j * block[seg], 0)
    q1 = jnp.where(live, jnp.minimum(q0 + block[seg], ends[seg]), 0)
    win = jnp.clip(q0 // align * align, 0, num_tokens - window)
    shift = ctx[seg] - ends[seg]  # position = token index + shift
    zero = jnp.zeros_like(i)
    table = jnp.stack([q0, q1, win, shift, seg, ctx[seg], zero, zero], axis=1)
    # Reversed: a sequence's last tiles see the most context, so they launch first (load balance);
    # the empty tiles, now first, exit at once.
    return table[::-1]


def _prefill_call(q, k_cache, v_cache, query_start, seq_lens, page_table, seq_mask, out, k_scale, v_scale, *, scale,
                  block_q, pages_per_block, num_warps, num_stages, kv_heads_fastest, interpret):
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch, max_pages = page_table.shape
    group = num_heads // num_kv_heads
    gp = next_pow2(group)
    if block_q is None:  # ~128 rows (64 for head_dim 256) of tokens x heads per tile
        block_q = max(1, (128 if head_dim <= 128 else 64) // gp)
    block_q = max(block_q, pl.cdiv(16, gp))  # tensor-core dots want >= 16 rows
    ppb = min(pages_per_block or max(1, 64 // page_size), next_pow2(max_pages))

    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    padded_tokens = max(num_tokens, block_q)  # tiny batches: give the window room
    if gp != group or padded_tokens != num_tokens:
        q4 = jnp.pad(q4, ((0, padded_tokens - num_tokens), (0, 0), (0, gp - group), (0, 0)))
    padded_pages = pl.cdiv(max_pages, ppb) * ppb
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 1), (0, padded_pages - max_pages)))  # [B+1, Pp]
    num_tiles = pl.cdiv(num_tokens, block_q) + batch + 1
    seg_mask = None if seq_mask is None else jnp.concatenate([seq_mask, jnp.ones((1,), bool)])
    tiles = _tile_table(query_start, seq_lens, padded_tokens, block_q, num_tiles, seg_mask)

    fp8 = is_fp8(k_cache.dtype)
    kernel = functools.partial(_prefill_kernel, scale=scale, block_q=block_q, pages_per_block=ppb,
                               page_size=page_size, table_width=padded_pages, fp8=fp8)
    # Grid dim 0 is the fastest-varying launch index (CUDA x): with kv heads there, a tile's heads
    # run side by side on the same pages and the (reversed) tile order is the launch order.
    if kv_heads_fastest:
        grid = (num_kv_heads, num_tiles)
        th = lambda f: lambda h, t: f(t, h)  # noqa: E731
    else:
        grid = (num_tiles, num_kv_heads)
        th = lambda f: f  # noqa: E731
    token_spec = pl.BlockSpec((padded_tokens, None, gp, head_dim), th(lambda t, h: (0, h, 0, 0)))
    k_rows, v_rows, kv_spec = row_view(k_cache, v_cache, th(lambda t, h: h))
    in_specs = [
        pl.BlockSpec((None, 8), th(lambda t, h: (t, 0))),
        token_spec,
        kv_spec,
        kv_spec,
        pl.BlockSpec(((batch + 1) * padded_pages,), th(lambda t, h: (0,))),
    ]
    args = [tiles, q4, k_rows, v_rows, table.reshape(-1)]  # flat: one array index per token (Triton's lowering
    # takes no second indexer on a row view)
    if fp8:
        in_specs += [pl.BlockSpec((1,), th(lambda t, h: (h,)))] * 2
        args += [k_scale, v_scale]
    # Write into `out` in place when its layout is the kernel's (no head / token padding).
    alias = out is not None and gp == group and padded_tokens == num_tokens
    if alias:
        in_specs.append(token_spec)
        args.append(out.reshape(num_tokens, num_kv_heads, group, head_dim))
    res = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=token_spec,
        out_shape=jax.ShapeDtypeStruct((padded_tokens, num_kv_heads, gp, head_dim), q.dtype),
        input_output_aliases={len(args) - 1: 0} if alias else {},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_prefill_attention_bq{block_q}_ppb{ppb}" + ("_fp8" if fp8 else ""),
    )(*args)
    res = res[:num_tokens, :, :group].reshape(num_tokens, num_heads, head_dim)
    if out is not None and not alias:  # rows of the sequences seq_mask leaves out come from `out`
        t = jnp.arange(num_tokens)
        seg = search_right(query_start, t) - 1  # [T]; >= batch: padding
        ours = (seg >= batch) | seq_mask[jnp.clip(seg, 0, batch - 1)]
        res = jnp.where(ours[:, None, None], res, out)
    return res


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def _check_args(q, k_cache, v_cache, query_start, seq_lens, page_table, k_scale=None, v_scale=None):
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {q.shape=}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache/v_cache must be equal [pages, page_size, kv_heads, head_dim]: "
                         f"{k_cache.shape=} {v_cache.shape=}")
    check_kv_scales(k_cache, k_scale, v_scale)
    _, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads/head_dim do not fit the cache: {q.shape=} {k_cache.shape=}")
    for name, n in (("head_dim", head_dim), ("page_size", page_size)):
        if n & (n - 1):
            raise ValueError(f"{name} must be a power of two (Triton block shapes), got {n}")
    if page_table.ndim != 2:
        raise ValueError(f"page_table must be [batch, pages_per_seq], got {page_table.shape=}")
    if seq_lens.shape != (page_table.shape[0],):
        raise ValueError(f"seq_lens must be [batch]: {seq_lens.shape=} {page_table.shape=}")
    if query_start.shape != (page_table.shape[0] + 1,):
        raise ValueError(f"query_start must be [batch + 1]: {query_start.shape=} {page_table.shape=}")


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_q", "pages_per_block", "num_warps", "num_stages", "kv_heads_fastest", "interpret"))
def ragged_prefill_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    seq_mask: jax.Array | None = None,
    out: jax.Array | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    scale: float | None = None,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    kv_heads_fastest: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a flattened ragged batch of new tokens over a paged KV cache.

    Args:
      q: `[num_tokens, num_heads, head_dim]`, the new tokens of all sequences back to back.
      k_cache, v_cache: `[num_pages, page_size, num_kv_heads, head_dim]`, new tokens' K/V already in.
      query_start: int32 `[batch + 1]`, sequence b's tokens are `q[query_start[b]:query_start[b+1]]`;
        padding sequences repeat the last value; tokens after `query_start[batch]` are padding.
      seq_lens: int32 `[batch]`, context length including the new tokens (0 for padding sequences).
      page_table: int32 `[batch, pages_per_seq]`; unused entries must be valid page ids.
      seq_mask: optional bool `[batch]`: only these sequences (and the padding tokens) are computed;
        the other sequences' rows are left unspecified, or taken from `out`.
      out: optional `[num_tokens, num_heads, head_dim]` holding the rows of the sequences seq_mask
        leaves out (another kernel's result); written in place where the layouts allow.
      k_scale, v_scale: float32 `[num_kv_heads]` for a float8_e4m3fn cache; None otherwise.
      scale: softmax scale, default `head_dim ** -0.5`.
      block_q: tokens per tile (power of two); default fills ~128 rows of tokens x heads-per-kv-head.
      pages_per_block: pages per K/V step (power of two); default 64 tokens' worth.
      num_warps, num_stages: Triton launch parameters.
      kv_heads_fastest: launch order; True runs a tile's kv heads side by side (page locality).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[num_tokens, num_heads, head_dim]` in q's dtype; padding tokens get zeros.
    """
    _check_args(q, k_cache, v_cache, query_start, seq_lens, page_table, k_scale, v_scale)
    if block_q is not None and (block_q < 1 or block_q & (block_q - 1)):
        raise ValueError(f"block_q must be a power of two, got {block_q=}")
    if pages_per_block is not None and (pages_per_block < 1 or pages_per_block & (pages_per_block - 1)):
        raise ValueError(f"pages_per_block must be a power of two, got {pages_per_block=}")
    if seq_mask is not None and seq_mask.shape != seq_lens.shape:
        raise ValueError(f"seq_mask must be [batch]: {seq_mask.shape=} {seq_lens.shape=}")
    if out is not None and (seq_mask is None or out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must come with a seq_mask and match q: {out.shape=} {q.shape=}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _prefill_call(q, k_cache, v_cache, query_start, seq_lens, page_table, seq_mask, out, k_scale, v_scale,
                         scale=scale,
                         block_q=block_q, pages_per_block=pages_per_block, num_warps=num_warps,
                         num_stages=num_stages, kv_heads_fastest=kv_heads_fastest, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale",))
def ragged_prefill_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Pure-jnp ragged prefill attention: each token gathers its sequence's whole page row (FP8 dequantized)."""
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch, max_pages = page_table.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    t = jnp.arange(num_tokens)
    seq = jnp.clip(search_right(query_start, t) - 1, 0, batch - 1)  # [T]
    real = t < query_start[-1]
    pos = seq_lens[seq] - (query_start[seq + 1] - t)  # [T]
    ctx = max_pages * page_size
    k = k_cache[page_table].reshape(batch, ctx, num_kv_heads, head_dim)  # [B, S, KVH, D]
    v = v_cache[page_table].reshape(batch, ctx, num_kv_heads, head_dim)
    if is_fp8(k.dtype):
        k, v = dequantize_kv(k, k_scale[:, None], q.dtype), dequantize_kv(v, v_scale[:, None], q.dtype)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("thgd,tshd->thgs", qg, k[seq], preferred_element_type=jnp.float32) * scale
    valid = (jnp.arange(ctx)[None, :] <= pos[:, None]) & real[:, None]  # [T, S]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("thgs,tshd->thgd", p.astype(v.dtype), v[seq], preferred_element_type=jnp.float32)
    o = o / jnp.where(l == 0.0, 1.0, l)
    return o.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
