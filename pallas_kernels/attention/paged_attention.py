"""Paged decode attention: one new query token per sequence (or a few: verify steps) against its paged KV cache.

KV cache layout (vLLM/flash): `k_cache, v_cache` each `[num_pages, page_size, num_kv_heads, head_dim]`.
Sequence b's token at position t lives in page `page_table[b, t // page_size]`, row `t % page_size`.
The query of sequence b is at position `seq_lens[b] - 1` and attends to positions `0..seq_lens[b]-1`.

One program handles (sequence, kv head, split): the G query heads sharing that kv head are one
`[G, head_dim]` matrix (padded to 16 rows, the smallest tensor-core tile), so each K/V byte is read
once. A program walks its split of the sequence in blocks of `pages_per_block` pages with an fp32 online
softmax. A block is gathered as `block_k` rows of the cache viewed as `[num_pages * page_size, D]` (one row
index per token, from the page table), so the load feeds the dots with nothing between them and Triton's
pipeliner can stage it `num_stages` deep. (Gathering whole pages, `[ppb, page_size, D]` reshaped to
`[block_k, D]`, held 39 KB of shared memory a program and had 67% of its shared-memory wavefronts in excess:
2.2 vs 2.8 TB/s at batch 32 on the H100, decode_attention_rows_b32_qwen3-4b_h100.json.)

With `num_splits > 1` (flash-decoding) every split writes an unnormalised fp32 partial plus its running
max / sum and a small merge kernel combines them; this keeps the GPU busy when the batch is small and the
contexts are long. (Merging in the attention kernel instead, by each (sequence, kv head)'s last split, measured
slower: local_step_tails_qwen3-4b_h100.json.)

A few query tokens per sequence (`query_len` Q > 1: speculative decoding's verify steps, 1 + k tokens): q is ragged
like the prefill kernel's (`query_start`), at most Q tokens a sequence, and a program's rows are its sequence's tokens
x the kv head's query heads (row r: token r // G, head r % G; Q * G padded to a power of two >= 16), so the Q tokens
share each K/V load as the G heads do, each row masked causally at its own position. Gathered and scattered by row
index (a program's tokens sit anywhere in q). The padding tokens after `query_start[B]` belong to no program: split 0
of each program zeroes a share of them. Q = 1 is the one-token kernel above, unchanged.

FP8 cache (float8_e4m3fn pages, `k_scale` / `v_scale` float32 per kv head): a program's kv head has one scale each,
so K is converted to q's dtype in registers as it is loaded (no multiply per element), its scale folded into the
softmax's scale, and V's applied once to the accumulator. The pages' bytes are what decode streams: half of bf16's.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py` for why).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.decode_merge import MERGE_KERNEL_MAX_SPLITS, merge_call, merge_splits_reference
from pallas_kernels.common import LOG2E, MASK_VALUE, next_pow2, search_right
from pallas_kernels.kv_fp8 import check_kv_scales, dequantize_kv, is_fp8

MIN_ROWS = 16  # tensor-core dots want M >= 16
TARGET_PROGRAMS = 264  # ~2 waves of the H100's 132 SMs, used to pick num_splits
# batch x kv heads from which one split fills the GPU: no split-K, no merge (Qwen3-4B batch 32 x 1k, 256 programs:
# 50.3 us at 2.84 TB/s vs 52.8 + 1.9 us merge with 2 splits on the H100, decode_attention_rows_b32_qwen3-4b_h100.json)
ONE_SPLIT_PROGRAMS = 192
# ... and below which (a lone sequence's kv heads) a step is latency-bound: 2 stages, and 128-token blocks where
# 8+ kv heads x the blocks of the context still make enough programs (Qwen3-4B batch 1 at 1k: 4.0 + 1.6 us merge
# vs 4.8 + 1.9 with 32-token blocks), else 64 (Qwen3-30B-A3B's 4 kv heads: 3.1 + 1.8 us vs 3.3 + 1.8 with 32 and
# 3.9 + 1.5 with 128, decode_attention_rows_b1_qwen3-30b-a3b_h100.json). 64-token blocks and 3 stages elsewhere
# (batch 8: 16.0 vs 16.8 us with 2 stages)
SMALL_BATCH_PROGRAMS = 64
SMEM_BUDGET = 160 * 1024  # bytes of K+V stage buffers a program may hold (the H100 has 227 KB a block)


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def token_rows(pt_ref, first_page, block_k: int, page_size: int) -> jax.Array:
    """[block_k] row indices, into a cache viewed as `[num_pages * page_size, D]` (`row_view`), of the block_k
    consecutive tokens from page slot `first_page` of the page-table row `pt_ref` [pages per sequence]."""
    tok = jnp.arange(block_k, dtype=jnp.int32)
    return pt_ref[first_page + tok // page_size] * page_size + tok % page_size


def row_view(k_cache: jax.Array, v_cache: jax.Array, index_map) -> tuple[jax.Array, jax.Array, pl.BlockSpec]:
    """The caches `[num_pages, page_size, KVH, D]` as `[num_pages * page_size, KVH, D]` (a free reshape) and the
    BlockSpec of one kv head's rows; `index_map(*grid_ids)` names the kv head."""
    num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    spec = pl.BlockSpec((shape[0], None, head_dim), lambda *ids: (0, index_map(*ids), 0))
    return k_cache.reshape(shape), v_cache.reshape(shape), spec


def _decode_kernel(
    q_ref,  # [T * H, D]: every query (T = B with one token per sequence; a sequence's rows of a kv head contiguous)
    k_ref,  # this kv head's slice of the whole K cache: [num_pages * page_size, D] (`row_view`)
    v_ref,  # [num_pages * page_size, D]
    pt_ref,  # [Pp]: this sequence's page ids (padded to whole blocks of ppb)
    len_ref,  # [1]: this sequence's context length
    *refs,  # query_len > 1: qs_ref [B + 1] (query_start). FP8: ks_ref, vs_ref [1] fp32 (this kv head's scales).
    # query_len > 1 with split-K: z_ref [T * H, D], the output whose padding tokens' rows split 0 zeroes. Then o_ref,
    # and split-K's m_ref, l_ref. o_ref: one split: [T * H, D] like q_ref. split-K: [Gp, D] unnormalised fp32 partial
    # m_ref [Gp], l_ref [Gp] fp32 (running max in log2 units, sum)
    scale: float,
    pages_per_block: int,
    num_heads: int,
    group: int,
    rows: int,
    kv_heads_fastest: bool,
    page_size: int,
    splits: int,
    fp8: bool,
    query_len: int = 1,
):
    refs = list(refs)
    qs_ref = refs.pop(0) if query_len > 1 else None
    ks_ref, vs_ref = (refs.pop(0), refs.pop(0)) if fp8 else (None, None)
    z_ref = refs.pop(0) if query_len > 1 and splits > 1 else None
    o_ref, *ml_refs = refs
    h, b = (pl.program_id(0), pl.program_id(1)) if kv_heads_fastest else (pl.program_id(1), pl.program_id(0))
    split = pl.program_id(2)
    head_dim = q_ref.shape[1]
    block_k = pages_per_block * page_size
    seq_len = len_ref[0]
    # The splits share this sequence's actual blocks, not the page table's width (max_model_len): sized by the
    # table, a 1k context in a 2k table left most splits empty and put its work in a few programs (batch 8 / 32
    # decode steps of Qwen3-4B 7% / 14% slower on the H100, local_step_splits_qwen3-4b_h100.json).
    seq_blocks = jnp.minimum(pl.cdiv(seq_len, block_k), pt_ref.shape[0] // pages_per_block)  # never past the table
    per_split = pl.cdiv(seq_blocks, splits)
    first_block = split * per_split
    n_blocks = jnp.clip(seq_blocks - first_block, 0, per_split)

    row = jnp.arange(rows, dtype=jnp.int32)
    if query_len == 1:
        # The G query heads of kv head h, padded to Gp rows in registers (masked loads, no padded copy of q
        # in HBM). The rows past G belong to the next kv head (or past the end): never stored.
        q_rows = pl.ds((b * num_heads + h * group), rows)
        q_mask = jnp.broadcast_to((row < group)[:, None], (rows, head_dim))
        q = plgpu.load(q_ref.at[q_rows], mask=q_mask, other=0.0)  # [Gp, D]
    else:
        # Row r: the sequence's token r // G (of its n_q <= Q new tokens, the last ones of its context), query head
        # h * G + r % G; rows past n_q x G are masked (gathered from row 0, never stored).
        q0 = qs_ref[b]
        n_q = jnp.clip(qs_ref[b + 1] - q0, 0, query_len)
        tok = row // group
        real = tok < n_q  # [Gp]
        q_rows = (q0 + tok) * num_heads + h * group + row % group  # [Gp] rows of q_ref
        o_rows = jnp.where(real, q_rows, q_ref.shape[0])  # masked rows: past the end (the interpreter drops them)
        q_rows = jnp.where(real, q_rows, 0)
        q_mask = jnp.broadcast_to(real[:, None], (rows, head_dim))
        q = jnp.where(q_mask, q_ref[q_rows], 0.0)  # [Gp, D]
        row_pos = jnp.minimum(seq_len - n_q + tok, seq_len - 1)  # [Gp]: its token's position (causal mask)
    qk_scale = scale * LOG2E  # softmax in base 2: exp2 is one instruction
    if fp8:
        qk_scale = qk_scale * ks_ref[0]

    def body(i, carry):
        acc, m_prev, l_prev = carry  # [Gp, D], [Gp], [Gp] fp32
        blk = first_block + i
        kv_rows = token_rows(pt_ref, blk * pages_per_block, block_k, page_size)  # [block_k]
        k = k_ref[kv_rows]  # [block_k, D]: one row per token, straight into the dots
        v = v_ref[kv_rows]
        if fp8:  # e4m3 -> q's dtype is exact; the scales are applied outside the loop
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        s = plgpu.dot(q, k, trans_b=True) * qk_scale  # [Gp, block_k] fp32
        pos = blk * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [block_k]
        if query_len == 1:
            s = jnp.where((pos < seq_len)[None, :], s, MASK_VALUE)
        else:
            s = jnp.where(pos[None, :] <= row_pos[:, None], s, MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))  # [Gp]
        alpha = jnp.exp2(m_prev - m_next)  # [Gp]
        p = jnp.exp2(s - m_next[:, None])  # [Gp, block_k]
        l_next = alpha * l_prev + p.sum(axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v)  # [Gp, D]
        return acc, m_next, l_next

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), jnp.finfo(jnp.float32).min, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, (acc, m, l))
    if fp8:
        acc = acc * vs_ref[0]

    if ml_refs:
        m_ref, l_ref = ml_refs
        o_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l
    else:
        l_safe = jnp.where(l == 0.0, 1.0, l)  # seq_len 0 (padding) -> zeros, not NaN
        out = (acc / l_safe[:, None]).astype(o_ref.dtype)
        if query_len == 1:
            plgpu.store(o_ref.at[q_rows], out, mask=q_mask)
        else:  # a scatter of rows: (row, column) index arrays
            plgpu.store(o_ref.at[o_rows[:, None], jnp.arange(head_dim)[None, :]], out, mask=q_mask)
    if query_len > 1:
        _zero_padding_tokens(qs_ref, z_ref if ml_refs else o_ref, b, h, split, num_heads, group)


def _zero_padding_tokens(qs_ref, o_ref, b, h, split, num_heads: int, group: int):
    """query_len > 1: the tokens past query_start[B] (bucket padding) belong to no sequence; split 0 of (sequence b,
    kv head h) zeroes kv head h's rows of tokens query_start[B] + b * Z ... + Z - 1 (Z = ceil(T / B)), so every padding
    row is written (as zeros: what the other attention kernels give padding tokens)."""
    tokens, batch = o_ref.shape[0] // num_heads, qs_ref.shape[0] - 1
    per_seq = pl.cdiv(tokens, batch)  # Z
    rows = max(16, next_pow2(per_seq * group))
    r = jnp.arange(rows, dtype=jnp.int32)
    tok = qs_ref[batch] + b * per_seq + r // group  # [rows]
    real = (r // group < per_seq) & (tok < tokens) & (split == 0)
    idx = jnp.where(real, tok * num_heads + h * group + r % group, o_ref.shape[0])  # masked: past the end
    head_dim = o_ref.shape[1]
    mask = jnp.broadcast_to(real[:, None], (rows, head_dim))
    cols = jnp.arange(head_dim, dtype=jnp.int32)
    plgpu.store(o_ref.at[idx[:, None], cols[None, :]], jnp.zeros((rows, head_dim), o_ref.dtype), mask=mask)


# ----------------------------------------------------------------------------------------------
# Wrapper: grid and block specs
# ----------------------------------------------------------------------------------------------
def _plan_splits(batch: int, num_kv_heads: int, num_blocks: int, num_splits: int | None,
                 target_programs: int = TARGET_PROGRAMS) -> int:
    """Split-K factor: enough programs for `target_programs` (none once ONE_SPLIT_PROGRAMS fill the GPU), at most
    one split per block of the table."""
    if num_splits is None:
        programs = batch * num_kv_heads
        num_splits = 1 if programs >= ONE_SPLIT_PROGRAMS else pl.cdiv(target_programs, programs)
    return max(1, min(num_splits, num_blocks))


def _decode_call(q, k_cache, v_cache, page_table, seq_lens, k_scale, v_scale, query_start, *, scale, pages_per_block,
                 num_splits, num_warps, num_stages, kv_heads_fastest, merge_kernel, target_programs, query_len,
                 interpret):
    num_tokens, num_heads, head_dim = q.shape
    batch = page_table.shape[0]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    rows = max(MIN_ROWS, next_pow2(group * query_len))
    max_pages = page_table.shape[1]
    ppb = min(pages_per_block, next_pow2(max_pages))
    num_blocks = pl.cdiv(max_pages, ppb)
    splits = _plan_splits(batch, num_kv_heads, num_blocks, num_splits, target_programs)
    if num_warps is None:  # H100 sweep: 2 warps when batch x kv heads fill the GPU, 4 with split-K
        num_warps = 2 if splits == 1 else 4
    padded_pages = num_blocks * ppb

    q2 = q.reshape(num_tokens * num_heads, head_dim)  # [T * H, D], a free reshape
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))  # [B, Pp]
    lens = seq_lens.astype(jnp.int32).reshape(batch, 1)  # [B, 1]

    fp8 = is_fp8(k_cache.dtype)
    multi = query_len > 1
    kernel = functools.partial(_decode_kernel, scale=scale, pages_per_block=ppb, num_heads=num_heads, group=group,
                               rows=rows, kv_heads_fastest=kv_heads_fastest, page_size=page_size, splits=splits,
                               fp8=fp8, **({"query_len": query_len} if multi else {}))
    # Grid dim 0 is the fastest-varying launch index (CUDA x). With kv heads there, the programs
    # running side by side read the same pages (different heads' slices of each row).
    if kv_heads_fastest:
        grid = (num_kv_heads, batch, splits)
        bhs = lambda f: lambda h, b, s: f(b, h, s)  # noqa: E731
    else:
        grid = (batch, num_kv_heads, splits)
        bhs = lambda f: f  # noqa: E731
    whole = pl.no_block_spec  # q (and the one-split output): rows picked in the kernel
    k_cache, v_cache, kv_spec = row_view(k_cache, v_cache, bhs(lambda b, h, s: h))
    in_specs = [
        whole,
        kv_spec,
        kv_spec,
        pl.BlockSpec((None, padded_pages), bhs(lambda b, h, s: (b, 0))),
        pl.BlockSpec((None, 1), bhs(lambda b, h, s: (b, 0))),
    ]
    args = [q2, k_cache, v_cache, table, lens]
    if multi:
        in_specs.append(whole)
        args.append(query_start.astype(jnp.int32))
    if fp8:
        in_specs += [pl.BlockSpec((1,), bhs(lambda b, h, s: (h,)))] * 2
        args += [k_scale, v_scale]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_tokens * num_heads, head_dim), q.dtype)
        out_specs = whole
    else:
        out_shape = [
            jax.ShapeDtypeStruct((splits, batch, num_kv_heads, rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, num_kv_heads, rows), jnp.float32),
            jax.ShapeDtypeStruct((splits, batch, num_kv_heads, rows), jnp.float32),
        ]
        out_specs = [
            pl.BlockSpec((None, None, None, rows, head_dim), bhs(lambda b, h, s: (s, b, h, 0, 0))),
            pl.BlockSpec((None, None, None, rows), bhs(lambda b, h, s: (s, b, h, 0))),
            pl.BlockSpec((None, None, None, rows), bhs(lambda b, h, s: (s, b, h, 0))),
        ]
        if multi:  # the output itself: split 0 zeroes its padding tokens' rows, the merge writes the rest
            out_shape.insert(0, jax.ShapeDtypeStruct((num_tokens * num_heads, head_dim), q.dtype))
            out_specs.insert(0, whole)
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_decode_attention_ppb{ppb}_s{splits}" + ("_fp8" if fp8 else "") + (f"_q{query_len}" if multi
                                                                                        else ""),
    )(*args)

    if splits > 1:  # flash-decoding epilogue: merge the per-split partial softmaxes
        padded, *out = out if multi else (None, *out)
        acc, m, l = out  # [S, B, KVH, Gp, D], [S, B, KVH, Gp] x2
        merge = dict(num_heads=num_heads, group=group, dtype=q.dtype, kv_heads_fastest=kv_heads_fastest,
                     interpret=interpret)
        if merge_kernel and splits <= MERGE_KERNEL_MAX_SPLITS:
            if multi:
                merge.update(query_len=query_len, query_start=query_start.astype(jnp.int32), out=padded)
            out = merge_call(acc, m, l, **merge)
        elif multi:
            out = _ragged_rows(merge_splits_reference(acc, m, l, group * query_len), query_start, query_len,
                               num_kv_heads, group, num_tokens).astype(q.dtype)
        else:
            out = merge_splits_reference(acc, m, l, group).astype(q.dtype)
    return out.reshape(num_tokens, num_heads, head_dim)


def _ragged_rows(merged, query_start, query_len: int, num_kv_heads: int, group: int, num_tokens: int) -> jax.Array:
    """[B, KVH, Q * G, D] merged rows (row r: token r // G, head r % G of the kv head) -> the ragged tokens' rows
    [T, H, D] (zeros for the padding tokens), in XLA (the no-merge-kernel variant)."""
    batch, _, _, head_dim = merged.shape
    dense = merged.reshape(batch, num_kv_heads, query_len, group, head_dim).transpose(0, 2, 1, 3, 4)  # [B,Q,KVH,G,D]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.clip(search_right(query_start, t) - 1, 0, batch - 1)  # [T]
    j = t - query_start[seq]
    real = (t < query_start[batch]) & (j < query_len)
    out = dense[seq, jnp.clip(j, 0, query_len - 1)].reshape(num_tokens, -1, head_dim)  # [T, H, D]
    return jnp.where(real[:, None, None], out, 0.0)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def plan_blocks(programs: int, page_size: int, head_dim: int, itemsize: int,
                num_stages: int | None = None) -> tuple[int, int]:
    """(pages_per_block, num_stages) for `programs` = batch x kv heads (H100 sweeps, see SMALL_BATCH_PROGRAMS):
    the block shrinks until `num_stages` K+V stage buffers fit SMEM_BUDGET."""
    small = programs < SMALL_BATCH_PROGRAMS
    num_stages = num_stages or (2 if small else 3)
    block_tokens = 128 if small and programs >= 8 else 64
    while block_tokens > page_size and num_stages * 2 * block_tokens * head_dim * itemsize > SMEM_BUDGET:
        block_tokens //= 2
    return max(1, block_tokens // page_size), num_stages


def _check_args(q, k_cache, v_cache, page_table, seq_lens, pages_per_block, num_splits, k_scale, v_scale,
                query_start=None, query_len: int = 1):
    if q.ndim != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim], got {q.shape=}")
    if not isinstance(query_len, int) or query_len < 1 or (query_start is None) != (query_len == 1):
        raise ValueError(f"query_len > 1 needs query_start (and 1 none): {query_len=}, "
                         f"query_start {'given' if query_start is not None else 'None'}")
    if query_start is not None and query_start.shape != (page_table.shape[0] + 1,):
        raise ValueError(f"query_start must be [batch + 1]: {query_start.shape=} {page_table.shape=}")
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache/v_cache must be equal [pages, page_size, kv_heads, head_dim]: "
                         f"{k_cache.shape=} {v_cache.shape=}")
    check_kv_scales(k_cache, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    batch = page_table.shape[0] if query_len > 1 else batch  # (ragged tokens: the sequences are the table's rows)
    _, page_size, num_kv_heads, kv_dim = k_cache.shape
    if kv_dim != head_dim:
        raise ValueError(f"k_cache head_dim must match q: {k_cache.shape=} {q.shape=}")
    if num_heads % num_kv_heads:
        raise ValueError(f"q heads must be a multiple of kv heads: {q.shape=} {k_cache.shape=}")
    for name, n in (("head_dim", head_dim), ("page_size", page_size)):
        if n & (n - 1):
            raise ValueError(f"{name} must be a power of two (Triton block shapes), got {n}")
    if page_table.ndim != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table must be [batch, pages_per_seq]: {page_table.shape=} {q.shape=}")
    if seq_lens.shape != (batch,):
        raise ValueError(f"seq_lens must be [batch]: {seq_lens.shape=} {q.shape=}")
    if pages_per_block is not None and (pages_per_block < 1 or pages_per_block & (pages_per_block - 1)):
        raise ValueError(f"pages_per_block must be a power of two >= 1, got {pages_per_block=}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1 or None, got {num_splits=}")


@functools.partial(jax.jit, static_argnames=(
    "scale", "pages_per_block", "num_splits", "num_warps", "num_stages", "kv_heads_fastest", "merge_kernel",
    "target_programs", "query_len", "interpret"))
def paged_decode_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    query_start: jax.Array | None = None,
    query_len: int = 1,
    scale: float | None = None,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_heads_fastest: bool = True,
    merge_kernel: bool = True,
    target_programs: int = TARGET_PROGRAMS,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of one query token per sequence (or a few: speculative decoding's verify steps) over a paged
    KV cache.

    Args:
      q: `[batch, num_heads, head_dim]`, the query of each sequence's newest token (position
        `seq_lens[b] - 1`). With `query_len` > 1: `[num_tokens, num_heads, head_dim]`, ragged as in
        `ragged_prefill_attention`: sequence b's tokens are `q[query_start[b]:query_start[b + 1]]`, at most
        `query_len` of them, the last of its context (token j of n at position `seq_lens[b] - n + j`, attending to
        positions <= its own); tokens from `query_start[batch]` on are padding (zeros out).
      k_cache, v_cache: `[num_pages, page_size, num_kv_heads, head_dim]`; the new token's K/V already
        written. Query head h reads kv head `h // (num_heads // num_kv_heads)`.
      page_table: int32 `[batch, pages_per_seq]`; unused entries must be valid page ids (e.g. 0).
      seq_lens: int32 `[batch]`, context length including the new token; 0 marks a padding
        sequence, whose output is zeros.
      query_start: int32 `[batch + 1]` with `query_len` > 1 (padding sequences repeat the last value), else None.
      query_len: the most new tokens a sequence has (static). A program's rows are its sequence's tokens x the kv
        head's query heads, so the tokens share each K/V load; 1 is the one-token kernel.
      k_scale, v_scale: float32 `[num_kv_heads]` for a float8_e4m3fn cache (a value is its e4m3 value times its
        kv head's scale); None otherwise.
      scale: softmax scale, default `head_dim ** -0.5`.
      pages_per_block: pages gathered per inner step (power of two); default: 64 tokens' worth (128 for a batch
        of a few sequences), fewer where the stage buffers would not fit SMEM_BUDGET.
      num_splits: flash-decoding splits of the context; None picks enough to fill the GPU
        (1 when batch * num_kv_heads already does).
      num_warps, num_stages: Triton launch parameters (None: 2 warps without split-K, else 4; 2 stages for
        small batches, else 3).
      kv_heads_fastest: launch order; True runs a sequence's kv heads side by side (page locality).
      merge_kernel: merge split-K partials in one Pallas kernel (else XLA's fusions of the same math).
      target_programs: the programs split-K aims for (default TARGET_PROGRAMS, ~2 waves of the H100).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      q's shape and dtype (softmax and accumulation in fp32).
    """
    _check_args(q, k_cache, v_cache, page_table, seq_lens, pages_per_block, num_splits, k_scale, v_scale,
                query_start, query_len)
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    plan_ppb, plan_stages = plan_blocks(page_table.shape[0] * num_kv_heads, page_size, head_dim,
                                        k_cache.dtype.itemsize, num_stages)
    num_stages = plan_stages if num_stages is None else num_stages
    pages_per_block = plan_ppb if pages_per_block is None else pages_per_block
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _decode_call(q, k_cache, v_cache, page_table, seq_lens, k_scale, v_scale, query_start, scale=scale,
                        pages_per_block=pages_per_block, num_splits=num_splits, num_warps=num_warps,
                        num_stages=num_stages, kv_heads_fastest=kv_heads_fastest, merge_kernel=merge_kernel,
                        target_programs=target_programs, query_len=query_len, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale",))
def paged_decode_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    seq_lens: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Pure-jnp paged decode attention (gathers every page of the table, FP8 dequantized); same contract as the
    kernel with one token per sequence (with query_len > 1 it is `ragged_prefill_attention_reference`'s)."""
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    ctx = page_table.shape[1] * page_size
    k = k_cache[page_table].reshape(batch, ctx, num_kv_heads, head_dim)  # [B, S, KVH, D]
    v = v_cache[page_table].reshape(batch, ctx, num_kv_heads, head_dim)
    if is_fp8(k.dtype):
        k, v = dequantize_kv(k, k_scale[:, None], q.dtype), dequantize_kv(v, v_scale[:, None], q.dtype)
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    s = jnp.einsum("bhgd,bshd->bhgs", qg, k, preferred_element_type=jnp.float32) * scale
    valid = jnp.arange(ctx)[None, :] < seq_lens[:, None]  # [B, S]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(axis=-1, keepdims=True)
    o = jnp.einsum("bhgs,bshd->bhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.where(l == 0.0, 1.0, l)
    return o.reshape(batch, num_heads, head_dim).astype(q.dtype)
