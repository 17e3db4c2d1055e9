"""Ragged MLA attention: DeepSeek's multi-head latent attention for prefill chunks, mixed and verify steps (a flattened
ragged batch of new tokens, as prefill_attention.py), in its two forms on one kernel.

Scores split by columns: s = q_a . k_a + q_pe . k_pe, with k_pe the decoupled RoPE key (one row per token that every
head shares); out = softmax(scale * s) @ v, causal per sequence, keys limited per sequence to positions < kv_limit.

- Absorbed form (`mla_absorbed_attention`): K and V are the paged latent cache itself (`latent [pages, page_size, R +
  P]`, rows [c | k_pe]), one "kv head" that every query head reads: k_a = v = c, q_a = q_nope through W_UK. Each
  gathered latent tile feeds both dots (as mla_decode.py). Per (query, key, head): 2 (R + P) + 2 R FLOPs (2176 for
  V2/V3), and no temporary.
- Expanded form (`mla_expanded_attention`): over the step's own new tokens only, K/V decompressed by kv_b_proj:
  `kv [T, H, nope + v]` (c @ W_UK | c @ W_UV, one matmul), k_pe the new rows' RoPE part: 2 (nope + P) + 2 v FLOPs
  (640), plus the decompression's 2 R (nope + v) a new token and head. Its temporary is bounded by the step's tokens
  (T x H x (nope + v)), never by the context.

Both return the rows' log-sum-exp (log2 units, -inf for rows without keys), so a caller adds the parts of one
softmax: a long chunk takes its own tokens expanded and the context before it absorbed (`merge_attention`).

Work split. A program is (kv head x head block, tile), tiles being block_q consecutive tokens of one sequence
(prefill_attention's tile table, its last tiles first); its rows are block_q tokens x the head block's heads. The
absorbed form's [rows, R] fp32 accumulator wants rows <= 32 on a GPU (mla_decode.py: a [64, 512] one spills), hence
head blocks of 16-32 heads and 1-2 tokens a tile at DeepSeek's 16-128 heads. Keys are gathered one row per token (the
load form of the paged kernels); blocks wholly visible to every row of a tile run unmasked.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`). Launch defaults unmeasured.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.mla_decode import _cols, plan_heads
from pallas_kernels.attention.paged_attention import token_rows
from pallas_kernels.attention.prefill_attention import _tile_table
from pallas_kernels.common import LOG2E, MASK_VALUE, next_pow2, search_right

MIN_ROWS = 16  # tensor-core dots want M, N and K >= 16
_Q0, _Q1, _WIN, _SHIFT, _SEQ, _LIMIT = 0, 1, 2, 3, 4, 6  # tile table columns (prefill_attention's; 6: the key limit)


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _mla_kernel(
    tile_ref,  # [8] int32: q0, q1 (valid tokens), window start, position shift, seq, ctx, key limit, 0
    qa_ref,  # [Tp, gb, Da]: the head block's q_a (absorbed: q_nope @ W_UK; expanded: q_nope)
    qpe_ref,  # [Tp, gb, Pp]: its q_pe, zero-padded to Pp columns
    kv_ref,  # [N, W]: this kv head's key / value rows (absorbed: the latent cache's rows; expanded: kv [T, H, .]'s)
    pe_ref,  # [N, We]: rows holding k_pe at columns [pe_col, pe_col + P) (the latent rows)
    *refs,  # paged: pt_ref [(B + 1) * Pw] (page table, flat). Then o_ref [Tp, gb, Dv], lse_ref [Tp, gb] fp32
    scale: float,
    block_q: int,
    block_k: int,
    page_size: int,
    table_width: int,
    v_col: int,
    pe_col: int,
    rope: int,
    paged: bool,
):
    pt_ref, o_ref, lse_ref = refs if paged else (None, *refs)
    _, group, da = qa_ref.shape
    rope_padded = qpe_ref.shape[2]
    dv = o_ref.shape[2]
    rows = block_q * group
    q0, q1, win = tile_ref[_Q0], tile_ref[_Q1], tile_ref[_WIN]
    shift, seq, limit = tile_ref[_SHIFT], tile_ref[_SEQ], tile_ref[_LIMIT]

    @pl.when(q1 > q0)
    def _():
        dtype = kv_ref.dtype  # dots in the keys' dtype (q may be wider)
        qa = qa_ref[pl.ds(win, block_q)].reshape(rows, da).astype(dtype)  # [rows, Da], row = token * gb + head
        qpe = qpe_ref[pl.ds(win, block_q)].reshape(rows, rope_padded).astype(dtype)  # [rows, Pp]
        tok = win + jnp.arange(rows, dtype=jnp.int32) // group  # [rows]
        row_pos = tok + shift  # [rows] each row's position in its sequence
        first_pos, last_pos = q0 + shift, q1 - 1 + shift
        n_full = jnp.maximum(jnp.minimum(first_pos + 1, limit), 0) // block_k  # blocks every row sees whole
        n_blocks = pl.cdiv(jnp.maximum(jnp.minimum(last_pos + 1, limit), 0), block_k)
        qk_scale = scale * LOG2E  # softmax in base 2

        def make_body(masked: bool):
            def body(j, carry):
                acc, m_prev, l_prev = carry  # [rows, Dv], [rows], [rows] fp32
                kv_pos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k] key positions
                if paged:
                    kv_rows = token_rows(pt_ref, seq * table_width + j * (block_k // page_size), block_k, page_size)
                else:  # contiguous: position p of the sequence is token p - shift, clamped (masked past the end)
                    kv_rows = jnp.minimum(kv_pos - shift, kv_ref.shape[0] - 1)
                ka = kv_ref[kv_rows, pl.ds(0, da)]  # [block_k, Da]
                k_pe = _cols(pe_ref, kv_rows, pe_col, rope, rope_padded)  # [block_k, Pp]
                v = ka if v_col == 0 and dv == da else kv_ref[kv_rows, pl.ds(v_col, dv)]  # absorbed: one tile
                s = plgpu.dot(qa, ka, trans_b=True) + plgpu.dot(qpe, k_pe, trans_b=True)  # [rows, block_k] fp32
                s = s * qk_scale
                if masked:
                    ok = (kv_pos[None, :] <= row_pos[:, None]) & (kv_pos < limit)[None, :]
                    s = jnp.where(ok, s, MASK_VALUE)
                m_next = jnp.maximum(m_prev, s.max(axis=1))
                alpha = jnp.exp2(m_prev - m_next)
                p = jnp.exp2(s - m_next[:, None])  # [rows, block_k]
                l_next = alpha * l_prev + p.sum(axis=1)
                acc = acc * alpha[:, None] + plgpu.dot(p.astype(dtype), v)  # [rows, Dv]
                return acc, m_next, l_next

            return body

        acc = jnp.zeros((rows, dv), jnp.float32)
        m = jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32)
        l = jnp.zeros((rows,), jnp.float32)
        carry = jax.lax.fori_loop(0, n_full, make_body(False), (acc, m, l))
        acc, m, l = jax.lax.fori_loop(n_full, n_blocks, make_body(True), carry)
        empty = l == 0.0  # no key (padding tokens, an empty context part): zeros and lse -inf
        out = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype).reshape(block_q, group, dv)
        lse = jnp.where(empty, -jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l))).reshape(block_q, group)
        mine = ((tok >= q0) & (tok < q1)).reshape(block_q, group)  # rows of this tile's tokens
        plgpu.store(o_ref.at[pl.ds(win, block_q)], out, mask=jnp.broadcast_to(mine[:, :, None], out.shape))
        plgpu.store(lse_ref.at[pl.ds(win, block_q)], lse, mask=mine)


# ----------------------------------------------------------------------------------------------
# Wrapper: tile table, grid and block specs
# ----------------------------------------------------------------------------------------------
def _mla_call(q_a, q_pe, kv, pe_rows, query_start, seq_lens, kv_limit, seq_mask, page_table, *, page_size, dv, v_col,
              pe_col, scale, block_q, block_k, block_h, num_warps, num_stages, interpret):
    """q_a [T, H, Da], q_pe [T, H, P]; kv [N, KVH, W] (KVH = 1: shared by every head, else H); pe_rows [N, We];
    page_table [B, Pw] or None (contiguous keys: sequence b's position p is row query_start[b] + p)."""
    num_tokens, num_heads, da = q_a.shape
    rope, kv_heads = q_pe.shape[2], kv.shape[1]
    group = num_heads // kv_heads
    gb, _ = plan_heads(group, block_h)
    head_blocks = group // gb
    if block_q is None:
        block_q = max(1, (32 if da > 128 else 64) // gb)  # absorbed: <= 32 rows (the [rows, R] accumulator)
    block_q = max(block_q, pl.cdiv(MIN_ROWS, gb))
    batch = seq_lens.shape[0]
    paged = page_table is not None
    if paged:
        max_pages = page_table.shape[1]
        block_k = max(block_k or 64, page_size, MIN_ROWS)
        pages_per_block = block_k // page_size
        width = pl.cdiv(max_pages, pages_per_block) * pages_per_block
        table = jnp.pad(page_table.astype(jnp.int32), ((0, 1), (0, width - max_pages))).reshape(-1)  # [(B+1) * Pw]
    else:
        block_k, width = max(block_k or 64, MIN_ROWS), 0

    rope_padded = max(MIN_ROWS, next_pow2(rope))
    padded = max(num_tokens, block_q)  # tiny batches: give the window room
    q5 = q_a.reshape(num_tokens, kv_heads, head_blocks, gb, da)
    pe5 = q_pe.reshape(num_tokens, kv_heads, head_blocks, gb, rope)
    q5 = jnp.pad(q5, ((0, padded - num_tokens),) + ((0, 0),) * 4)
    pe5 = jnp.pad(pe5, ((0, padded - num_tokens),) + ((0, 0),) * 3 + ((0, rope_padded - rope),))

    num_tiles = pl.cdiv(num_tokens, block_q) + batch + 1
    seg_mask = None if seq_mask is None else jnp.concatenate([seq_mask, jnp.ones((1,), bool)])
    tiles = _tile_table(query_start, seq_lens, padded, block_q, num_tiles, seg_mask)
    limit = jnp.concatenate([kv_limit.astype(jnp.int32), jnp.zeros((1,), jnp.int32)])  # the padding: no keys
    tiles = tiles.at[:, _LIMIT].set(limit[tiles[:, _SEQ]])

    kernel = functools.partial(_mla_kernel, scale=scale, block_q=block_q, block_k=block_k, page_size=page_size,
                               table_width=width, v_col=v_col, pe_col=pe_col, rope=rope, paged=paged)
    grid = (kv_heads * head_blocks, num_tiles)  # a tile's heads side by side (the same keys), tiles in table order
    split = lambda f: lambda i, t: f(i // head_blocks, i % head_blocks)  # noqa: E731
    q_spec = pl.BlockSpec((padded, None, None, gb, da), split(lambda h, b: (0, h, b, 0, 0)))
    in_specs = [
        pl.BlockSpec((None, 8), lambda i, t: (t, 0)),
        q_spec,
        pl.BlockSpec((padded, None, None, gb, rope_padded), split(lambda h, b: (0, h, b, 0, 0))),
        pl.BlockSpec((kv.shape[0], None, kv.shape[2]), split(lambda h, b: (0, h, 0))),
        pl.no_block_spec,
    ]
    args = [tiles, q5, pe5, kv, pe_rows]
    if paged:
        in_specs.append(pl.no_block_spec)
        args.append(table)
    out, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((padded, None, None, gb, dv), split(lambda h, b: (0, h, b, 0, 0))),
                   pl.BlockSpec((padded, None, None, gb), split(lambda h, b: (0, h, b, 0)))],
        out_shape=[jax.ShapeDtypeStruct((padded, kv_heads, head_blocks, gb, dv), q_a.dtype),
                   jax.ShapeDtypeStruct((padded, kv_heads, head_blocks, gb), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or (8 if block_q * gb * dv > 8192 else 4),
                                             num_stages=num_stages),
        interpret=interpret,
        name=f"mla_{'absorbed' if paged else 'expanded'}_attention_bq{block_q}_h{gb}_bk{block_k}",
    )(*args)
    return out[:num_tokens].reshape(num_tokens, num_heads, dv), lse[:num_tokens].reshape(num_tokens, num_heads)

# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def check_supported(latent: jax.Array, kv_lora_rank: int, qk_nope_dim: int, v_dim: int) -> str | None:
    """Why the kernels cannot take an MLA layer of these sizes over this latent cache (callers fall back to the
    reference), or None. The RoPE part may have any width (its columns are gathered padded)."""
    if latent.ndim != 3 or not 0 < kv_lora_rank < latent.shape[2]:
        return f"latent must be [pages, page_size, kv_lora_rank + rope]: {latent.shape=} {kv_lora_rank=}"
    for name, n in (("kv_lora_rank", kv_lora_rank), ("qk_nope_dim", qk_nope_dim), ("v_dim", v_dim)):
        if n < MIN_ROWS or n & (n - 1):
            return f"{name} must be a power of two >= {MIN_ROWS} (Triton block shapes), got {n}"
    if latent.shape[1] & (latent.shape[1] - 1):
        return f"page_size must be a power of two, got {latent.shape[1]}"
    if latent.size >= 2**31:  # the gathers' element offsets (row * L + column) are int32
        return f"the latent cache must hold < 2**31 values per layer, got {latent.shape=}"
    return None


def _check_launch(block_q, block_k, block_h):
    for name, n in (("block_q", block_q), ("block_k", block_k), ("block_h", block_h)):
        if n is not None and (n < 1 or n & (n - 1)):
            raise ValueError(f"{name} must be a power of two >= 1 or None, got {n}")


_LAUNCH = ("scale", "block_q", "block_k", "block_h", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_LAUNCH)
def mla_absorbed_attention(
    q_latent: jax.Array,
    q_pe: jax.Array,
    latent: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    kv_limit: jax.Array | None = None,
    seq_mask: jax.Array | None = None,
    *,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Absorbed-form MLA attention of a flattened ragged batch of new tokens over the paged latent cache.

    Args:
      q_latent: `[T, H, R]`, each head's query in the latent space (q_nope through W_UK).
      q_pe: `[T, H, P]`, its RoPE part (RoPE applied).
      latent: `[num_pages, page_size, R + P]`, rows [c | k_pe]; the new tokens' rows already written.
      query_start, seq_lens, page_table: as `ragged_prefill_attention` (sequence b's tokens are the last of its
        seq_lens[b]; padding sequences repeat the last query_start and have length 0).
      kv_limit: int32 `[B]`: sequence b's tokens see only keys at positions < kv_limit[b] (default seq_lens: causal).
      seq_mask: bool `[B]`: only these sequences' rows (and the padding tokens') are computed; the others' are left
        unspecified.
      scale: softmax scale.
      block_q, block_k, block_h: tokens a tile, keys an inner step, heads a program (powers of two; None: defaults).
      num_warps, num_stages: Triton launch parameters.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      (`[T, H, R]` in q's dtype: the softmax-weighted latent, for W_UV; `[T, H]` float32 log-sum-exp of the scaled
      scores in log2 units, -inf for rows without keys (their output is zeros)).
    """
    reason = check_supported(latent, q_latent.shape[2], MIN_ROWS, MIN_ROWS)
    if reason is not None:
        raise ValueError(reason)
    if q_latent.ndim != 3 or q_pe.shape[:2] != q_latent.shape[:2] or q_latent.shape[2] + q_pe.shape[2] != \
            latent.shape[2]:
        raise ValueError(f"q_latent [T, H, R] and q_pe [T, H, P] must fit latent [.., R + P]: {q_latent.shape=} "
                         f"{q_pe.shape=} {latent.shape=}")
    if page_table.ndim != 2 or seq_lens.shape != page_table.shape[:1] or \
            query_start.shape != (page_table.shape[0] + 1,):
        raise ValueError(f"page_table [B, P], seq_lens [B], query_start [B + 1]: {page_table.shape=} "
                         f"{seq_lens.shape=} {query_start.shape=}")
    _check_launch(block_q, block_k, block_h)
    num_pages, page_size, dim = latent.shape
    rank = q_latent.shape[2]
    kv_limit = seq_lens if kv_limit is None else kv_limit
    return _mla_call(q_latent, q_pe, latent.reshape(num_pages * page_size, 1, dim),
                     latent.reshape(num_pages * page_size, dim), query_start, seq_lens, kv_limit, seq_mask,
                     page_table, page_size=page_size, dv=rank, v_col=0, pe_col=rank, scale=scale, block_q=block_q,
                     block_k=block_k, block_h=block_h, num_warps=num_warps, num_stages=num_stages,
                     interpret=interpret)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank",) + _LAUNCH)
def mla_expanded_attention(
    q_nope: jax.Array,
    q_pe: jax.Array,
    kv: jax.Array,
    rows: jax.Array,
    query_start: jax.Array,
    seq_mask: jax.Array | None = None,
    *,
    kv_lora_rank: int,
    scale: float,
    block_q: int | None = None,
    block_k: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Expanded-form MLA attention of each sequence's new tokens over themselves (causal), from their decompressed
    keys and values: the part of a long chunk's attention that its own tokens make.

    Args:
      q_nope: `[T, H, nope]`; q_pe: `[T, H, P]` (RoPE applied).
      kv: `[T, H, nope + v]`: each new token's c through kv_b_proj (per head k_nope | v).
      rows: `[T, R + P]`: the new tokens' latent rows [c | k_pe] (k_pe read at column kv_lora_rank).
      query_start: int32 `[B + 1]` (as `ragged_prefill_attention`).
      seq_mask, scale, launch parameters: as `mla_absorbed_attention`.

    Returns:
      (`[T, H, v]` in q's dtype, `[T, H]` float32 log-sum-exp in log2 units, as `mla_absorbed_attention`).
    """
    num_tokens, num_heads, nope = q_nope.shape
    dv = kv.shape[2] - nope
    if kv.shape[:2] != (num_tokens, num_heads) or q_pe.shape[:2] != (num_tokens, num_heads) or \
            rows.shape[0] != num_tokens or not 0 < kv_lora_rank < rows.shape[1]:
        raise ValueError(f"shapes do not fit: {q_nope.shape=} {q_pe.shape=} {kv.shape=} {rows.shape=} "
                         f"{kv_lora_rank=}")
    for name, n in (("qk_nope_dim", nope), ("v_dim", dv)):
        if n < MIN_ROWS or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= {MIN_ROWS}, got {n}")
    _check_launch(block_q, block_k, block_h)
    q_len = (query_start[1:] - query_start[:-1]).astype(jnp.int32)  # each sequence's context: its new tokens
    return _mla_call(q_nope, q_pe, kv, rows, query_start, q_len, q_len, seq_mask, None, page_size=1, dv=dv,
                     v_col=nope, pe_col=kv_lora_rank, scale=scale, block_q=block_q, block_k=block_k, block_h=block_h,
                     num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def merge_attention(o1: jax.Array, lse1: jax.Array, o2: jax.Array, lse2: jax.Array) -> jax.Array:
    """The softmax over two disjoint key sets from each one's normalised output `[T, H, D]` and log-sum-exp `[T, H]`
    (log2 units, -inf: no keys, whatever its output rows hold)."""
    m = jnp.maximum(lse1, lse2)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w1, w2 = jnp.exp2(lse1 - m)[..., None], jnp.exp2(lse2 - m)[..., None]  # [T, H, 1]; -inf -> 0
    num = jnp.where(w1 > 0, w1 * o1.astype(jnp.float32), 0.0) + jnp.where(w2 > 0, w2 * o2.astype(jnp.float32), 0.0)
    return (num / jnp.where(w1 + w2 == 0, 1.0, w1 + w2)).astype(o1.dtype)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def _reference(q_a, q_pe, k_a, k_pe, v, query_start, seq_lens, kv_limit, scale):
    """Pure-jnp float32 core: k_a [B, S, KVH, Da], k_pe [B, S, P], v [B, S, KVH, Dv]: sequence b's keys at positions
    0..S-1. -> ([T, H, Dv] in q's dtype, [T, H] lse in log2 units)."""
    num_tokens, num_heads, _ = q_a.shape
    batch, ctx, kv_heads, _ = k_a.shape
    f32 = jnp.float32
    t = jnp.arange(num_tokens)
    seq = jnp.clip(search_right(query_start, t) - 1, 0, batch - 1)  # [T]
    real = t < query_start[-1]
    pos = seq_lens[seq] - (query_start[seq + 1] - t)  # [T]
    qa = q_a.reshape(num_tokens, kv_heads, num_heads // kv_heads, -1).astype(f32)
    qp = q_pe.reshape(num_tokens, kv_heads, num_heads // kv_heads, -1).astype(f32)
    s = (jnp.einsum("thgd,tshd->thgs", qa, k_a[seq].astype(f32))
         + jnp.einsum("thgd,tsd->thgs", qp, k_pe[seq].astype(f32))) * scale  # [T, KVH, G, S]
    kv_pos = jnp.arange(ctx)[None, :]
    valid = (kv_pos <= pos[:, None]) & (kv_pos < kv_limit[seq][:, None]) & real[:, None]  # [T, S]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("thgs,tshd->thgd", p, v[seq].astype(f32)) / jnp.where(l == 0.0, 1.0, l)
    lse = jnp.where(l[..., 0] == 0.0, -jnp.inf, (m[..., 0] + jnp.log(jnp.where(l[..., 0] == 0, 1.0, l[..., 0]))))
    return o.reshape(num_tokens, num_heads, -1).astype(q_a.dtype), (lse * LOG2E).reshape(num_tokens, num_heads)


@functools.partial(jax.jit, static_argnames=("scale",))
def mla_absorbed_attention_reference(q_latent, q_pe, latent, query_start, seq_lens, page_table, kv_limit=None, *,
                                     scale: float):
    """`mla_absorbed_attention` in jnp (every sequence gathers its whole page-table row)."""
    batch, max_pages = page_table.shape
    rank = q_latent.shape[2]
    rows = latent[page_table].reshape(batch, max_pages * latent.shape[1], -1)  # [B, S, R + P]
    kv_limit = seq_lens if kv_limit is None else kv_limit
    return _reference(q_latent, q_pe, rows[:, :, None, :rank], rows[..., rank:], rows[:, :, None, :rank], query_start,
                      seq_lens, kv_limit, scale)


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "scale"))
def mla_expanded_attention_reference(q_nope, q_pe, kv, rows, query_start, *, kv_lora_rank: int, scale: float):
    """`mla_expanded_attention` in jnp (each sequence's new tokens gathered into a [B, T] window)."""
    num_tokens, _, nope = q_nope.shape
    q_len = query_start[1:] - query_start[:-1]
    idx = jnp.minimum(query_start[:-1, None] + jnp.arange(num_tokens)[None, :], num_tokens - 1)  # [B, T]
    return _reference(q_nope, q_pe, kv[idx][..., :nope], rows[idx][..., kv_lora_rank:], kv[idx][..., nope:],
                      query_start, q_len, q_len, scale)
