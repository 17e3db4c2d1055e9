"""Ragged (chunked) prefill attention over a paged KV cache, Mosaic GPU (Hopper: TMA + wgmma).

Same contract as `prefill_attention.ragged_prefill_attention` (flattened new tokens of several
sequences, each token attending causally to its sequence's cached pages), built the FlashAttention-3
way after JAX's `pallas/ops/gpu/attention_mgpu.py`:

- Work item = (query head, tile of consecutive tokens of one sequence). The grid is persistent:
  one CTA per SM (the SMEM use allows no second), each walking its items; the items, ranked by
  cost (K/V blocks), are dealt to the CTAs in snake order round by round, so the short causal
  tiles fill in behind the long ones.
- Three warpgroups per CTA: two compute warpgroups own block_q query rows each; the third
  (memory) loads each item's query window into one of `q_buffers` SMEM buffers and streams K/V
  blocks into a ring of `max_steps` SMEM slots with TMA, one copy per page (the page table is read
  as scalars from GMEM), waiting for the compute warpgroups to release a buffer or slot before
  refilling it. The ring runs on across items, so the next item's Q and first K/V blocks land
  while the compute warpgroups finish the current item and store its output.
- The compute warpgroups run S = Q K^T and O += P V on the tensor cores (wgmma), softmax in
  registers, and take turns on the tensor cores through a schedule barrier, so one's softmax
  overlaps the other's matmuls. Blocks fully below a warpgroup's first row run unmasked; only the
  diagonal blocks apply the causal mask. (FlashAttention-3's intra-warpgroup pipeline, S of the
  next block issued with P V of the current one, measured 26% slower on the H100: ptxas
  serializes the wgmmas (C7513), as the register P operand is fenced between the two issues.)
- Tiles are not aligned to sequence starts: a tile's query window (2 x block_q rows, starting at a
  multiple of 8, as Mosaic GPU's TMA addresses GMEM in whole 8-row SMEM tiles) is clamped inside
  [0, T), so it may hold rows of the neighbouring sequences; a tile takes 2 x block_q - 8 tokens
  (2 x block_q when its sequence starts at a multiple of 8).
  A tile stores its rows by 8-row chunks: straight into the output where the chunk is all its own,
  into a small per-tile edge buffer where a sequence boundary cuts the chunk; the wrapper scatters
  the edge rows (at most 16 per tile) into place. No races between tiles, no full-output copy.

The tile table is the Triton kernel's (`prefill_attention._tile_table`), sorted by cost.

Interpret mode (CPU): jax 0.11.2's Mosaic GPU interpreter has no `pl.run_state` and wants both
wgmma operands in SMEM, so with `interpret` set P goes through an SMEM buffer and each P V product
lands in a fresh accumulator that is added in registers. Everything else (TMA, barriers, ring,
paging, masking, tile table, chunked stores) is the code that runs on the GPU, and a CPU test
lowers the GPU path for CUDA with `jax.export` (Mosaic GPU's layout inference runs there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.prefill_attention import (
    _Q0,
    _Q1,
    _SEQ,
    _SHIFT,
    _WIN,
    _check_args,
    _tile_table,
    ragged_prefill_attention_reference,
)
from pallas_kernels.common import LOG2E
from pallas_kernels.kv_fp8 import is_fp8

COMPUTE_WGS = 2
# Query windows start at multiples of the SMEM tile's 8 rows (Mosaic GPU's TMA addresses GMEM in
# tiles), so a tile holds 2 * block_q - 8 tokens and its window of 2 * block_q rows covers them.
ALIGN = 8
SMEM_BYTES = 227 * 1024  # per CTA on Hopper
_STEPS = 6  # tile table column (spare in `_tile_table`) filled here: the tile's K/V block count


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _kernel(tile_ref, q_ref, k_ref, v_ref, pt_ref, out_ref, edge_ref, scoped, *, scale, block_q, block_kv,
            max_steps, q_buffers, num_ctas, num_rounds, p_in_smem):
    # tile_ref [num_tiles, 8] int32 (GMEM, costliest first), q_ref [Tp, H, D],
    # k_ref/v_ref [pages, page_size, KVH, D], pt_ref [B + 1, Pp] int32, out_ref [Tp, H, D],
    # edge_ref [num_tiles, 2, ALIGN, H, D]
    smem, (k_ready, v_ready, q_ready), (k_free, v_free, q_free), schedule = scoped
    qo_smem3, k_smem, v_smem, p_smem2 = smem  # qo_smem3 [q_buffers, COMPUTE_WGS, block_q, D]
    _, num_heads, head_dim = q_ref.shape
    page_size, num_kv_heads = k_ref.shape[1], k_ref.shape[2]
    pages_per_block = block_kv // page_size
    dtype = q_ref.dtype
    qk_scale = scale * LOG2E
    wg = lax.axis_index("wg")
    cta = lax.axis_index("ctas")

    def work_item(r):
        """The CTA's r-th work item (query head, tile) and its K/V block count. Items are ranked by
        cost (tile-major, heads fastest) and dealt to the CTAs in snake order, round by round."""
        rank = r * num_ctas + jnp.where(r % 2 == 0, cta, num_ctas - 1 - cta)
        tile, head = lax.div(rank, jnp.int32(num_heads)), lax.rem(rank, jnp.int32(num_heads))
        q0, q1, win = tile_ref[tile, _Q0], tile_ref[tile, _Q1], tile_ref[tile, _WIN]
        shift, seq, steps = tile_ref[tile, _SHIFT], tile_ref[tile, _SEQ], tile_ref[tile, _STEPS]
        return tile, head, q0, q1, win, shift, seq, steps

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WGS)
    def _compute_wg():
        plgpu.set_max_registers(240, action="increase")

        def item(r, carry):  # g0: K/V blocks of the CTA's earlier items (ring position), n: their count
            g0, n = carry
            tile, head, q0, q1, win, shift, _, cta_steps = work_item(r)
            qbuf = lax.rem(n, jnp.int32(q_buffers))
            pl.when(q1 > q0)(functools.partial(_attend, tile, head, q0, q1, win, shift, cta_steps, g0, qbuf))
            return g0 + cta_steps, n + (q1 > q0).astype(jnp.int32)

        def _attend(tile, head, q0, q1, win, shift, cta_steps, g0, qbuf):
            qo_smem = qo_smem3.at[qbuf, wg]
            base = pl.multiple_of(win + wg * block_q, ALIGN)  # token index of this warpgroup's row 0
            first = jnp.maximum(base, q0) + shift  # position of its first / last valid row
            last = jnp.minimum(base + block_q, q1) - 1 + shift
            kv_steps = jnp.where(last >= first, pl.cdiv(jnp.maximum(last + 1, 0), block_kv), 0)
            full_steps = jnp.minimum(jnp.maximum(first + 1, 0) // block_kv, kv_steps)

            def slot_of(step):
                return lax.rem(g0 + step, jnp.int32(max_steps))

            plgpu.barrier_wait(q_ready.at[qbuf])  # loaded by the memory warpgroup

            m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[slot_of(0)])

            pl.when(wg == 1)(schedule_barrier)

            def kv_step(step, carry, masked: bool):
                acc, m_i, l_i = carry  # [bq, D] f32, [bq] f32 (log2 domain, scaled), [bq] f32
                slot = slot_of(step)

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
                    schedule_barrier()
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))  # [bq, bkv]
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    rows = plgpu.broadcasted_iota(jnp.int32, s.shape, 0, layout=plgpu.Layout.WGMMA)
                    cols = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA)
                    s = jnp.where(rows + (base + shift) >= cols + step * block_kv, s, -jnp.inf)
                # m is kept in the scaled log2 domain, so p = exp2(s * c - m) is one FMA per element.
                m_new = jnp.maximum(m_i, s.max(axis=1) * qk_scale)
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha
                p16 = p.astype(dtype)

                def end_softmax():
                    plgpu.barrier_arrive(schedule)
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(schedule)

                # Ordering as in JAX's attention_mgpu (measured there to matter).
                if head_dim <= 128:
                    l_i = l_i + p.sum(axis=1)
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                    end_softmax()
                else:
                    end_softmax()
                    l_i = l_i + p.sum(axis=1)

                def wait_next_k():
                    @pl.when(step + 1 < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[slot_of(step + 1)])

                if p_in_smem:
                    p_smem = p_smem2.at[wg]
                    p_smem[...] = p16
                    plgpu.commit_smem()

                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                        wait_next_k()
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv, plgpu.ACC((block_q, head_dim), jnp.float32))
                else:
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        wait_next_k()

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            def drain(step, _):
                # Keep the ring and the schedule barrier in step with the other warpgroup (every
                # warpgroup observes every phase of the barriers it uses).
                slot = slot_of(step)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()
                schedule_barrier()

            carry = (acc, m_i, l_i)
            carry = lax.fori_loop(0, full_steps, functools.partial(kv_step, masked=False), carry)
            acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(kv_step, masked=True), carry)
            lax.fori_loop(kv_steps, cta_steps, drain, None)
            pl.when(wg == 0)(schedule_barrier)

            l_i = jnp.where(l_i == 0.0, 1.0, l_i)  # rows without context (padding) -> zeros
            qo_smem[...] = (acc / lax.broadcast_in_dim(l_i, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            # Store by 8-row chunks: a chunk wholly inside [q0, q1) goes straight to its rows of the
            # output; the chunk holding an unaligned q0 (q1) goes to edge slot 0 (1), which the wrapper
            # scatters into place, since a neighbouring tile owns the chunk's other rows.
            for c in range(block_q // ALIGN):
                t0 = base + c * ALIGN
                rows = qo_smem.at[pl.ds(c * ALIGN, ALIGN)]
                inside = (t0 >= q0) & (t0 + ALIGN <= q1)
                edge = (t0 < q1) & (t0 + ALIGN > q0) & ~inside
                # (pl.when rather than the copy's predicate: the interpreter has no predicated copies)
                pl.when(inside)(functools.partial(
                    plgpu.copy_smem_to_gmem, rows, out_ref.at[pl.ds(pl.multiple_of(t0, ALIGN), ALIGN), head]))
                pl.when(edge & (t0 < q0))(
                    functools.partial(plgpu.copy_smem_to_gmem, rows, edge_ref.at[tile, 0, :, head]))
                pl.when(edge & (t0 >= q0))(
                    functools.partial(plgpu.copy_smem_to_gmem, rows, edge_ref.at[tile, 1, :, head]))
            # A later item's Q lands in this buffer: release it once the stores have read it.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(q_free.at[qbuf])

        lax.fori_loop(0, num_rounds, item, (jnp.int32(0), jnp.int32(0)))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory_wg():
        plgpu.set_max_registers(24, action="decrease")  # TMA issue only (H100: +1-2%)

        def load(seq, step, slot, src, dst, ready, kv_head):
            for p in range(pages_per_block):
                page = pt_ref[seq, step * pages_per_block + p]
                plgpu.copy_gmem_to_smem(src.at[page, :, kv_head], dst.at[slot, pl.ds(p * page_size, page_size)],
                                        ready.at[slot])

        def item(r, carry):
            g0, n = carry
            _, head, q0, q1, win, _, seq, steps = work_item(r)
            kv_head = lax.div(head, jnp.int32(num_heads // num_kv_heads))

            @pl.when(q1 > q0)
            def _load_q():  # the item's query window, half per compute warpgroup
                qbuf = lax.rem(n, jnp.int32(q_buffers))
                pl.when(n >= q_buffers)(lambda: plgpu.barrier_wait(q_free.at[qbuf]))
                for w in range(COMPUTE_WGS):
                    rows = q_ref.at[pl.ds(pl.multiple_of(win + w * block_q, ALIGN), block_q), head]
                    plgpu.copy_gmem_to_smem(rows, qo_smem3.at[qbuf, w], q_ready.at[qbuf])

            @pl.loop(0, steps)
            def _(step):
                g = g0 + step  # the CTA's K/V block count: ring slot and refill waits run across items
                slot = lax.rem(g, jnp.int32(max_steps))
                refill = g >= max_steps
                pl.when(refill)(lambda: plgpu.barrier_wait(k_free.at[slot]))
                load(seq, step, slot, k_ref, k_smem, k_ready, kv_head)
                pl.when(refill)(lambda: plgpu.barrier_wait(v_free.at[slot]))
                load(seq, step, slot, v_ref, v_smem, v_ready, kv_head)

            return g0 + steps, n + (q1 > q0).astype(jnp.int32)

        total, items = lax.fori_loop(0, num_rounds, item, (jnp.int32(0), jnp.int32(0)))

        @pl.loop(jnp.maximum(items - q_buffers, 0), items)
        def _(i):
            plgpu.barrier_wait(q_free.at[lax.rem(i, jnp.int32(q_buffers))])

        @pl.loop(jnp.maximum(total - max_steps, 0), total)
        def _(g):  # the last release of each slot (nothing to refill)
            slot = lax.rem(g, jnp.int32(max_steps))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])


# ----------------------------------------------------------------------------------------------
# Wrapper: tile table, SMEM, barriers, scatter of the edge chunks
# ----------------------------------------------------------------------------------------------
def long_sequences(query_start: jax.Array, min_query_len: int) -> jax.Array:
    """bool [B]: the sequences the kernel computes with `min_query_len` (> 1); a caller fills the rest."""
    return query_start[1:] - query_start[:-1] >= min_query_len


def _num_sms(interpret) -> int:
    """CTAs of the persistent grid: the GPU's SM count (a few under the CPU interpreter)."""
    device = jax.devices()[0]
    return 4 if interpret or device.platform != "gpu" else device.core_count


def _mgpu_call(q, k_cache, v_cache, query_start, seq_lens, page_table, *, scale, block_q, block_kv,
               max_steps, q_buffers, num_ctas, min_query_len, interpret):
    num_tokens, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_cache.shape
    batch, max_pages = page_table.shape
    cta_q = COMPUTE_WGS * block_q
    pages_per_block = block_kv // page_size
    dtype = q.dtype

    tile_tokens = cta_q - ALIGN
    padded_tokens = pl.cdiv(max(num_tokens, cta_q), ALIGN) * ALIGN  # room for an aligned window
    if padded_tokens != num_tokens:
        q = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    padded_pages = pl.cdiv(max_pages, pages_per_block) * pages_per_block
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 1), (0, padded_pages - max_pages)))  # [B+1, Pp]
    if min_query_len > 1:  # sequences with fewer new tokens (and the padding tokens) get no tiles
        seg_mask = jnp.concatenate([long_sequences(query_start, min_query_len), jnp.zeros((1,), bool)])
        # each selected sequence adds at most one partial tile
        num_tiles = pl.cdiv(num_tokens, tile_tokens) + min(batch, num_tokens // min_query_len)
    else:
        seg_mask = None
        num_tiles = pl.cdiv(num_tokens, tile_tokens) + batch + 1
    tiles = _tile_table(query_start, seq_lens, padded_tokens, tile_tokens, num_tiles, seg_mask,
                        window=cta_q, align=ALIGN)  # [num_tiles, 8]
    # Persistent CTAs (one per SM: the SMEM ring allows no second) deal the (head, tile) items out
    # costliest first, so the short causal tiles fill in behind the long ones and the memory
    # warpgroup streams the next item's K/V while the compute warpgroups finish the current one.
    # K/V blocks a tile needs: up to its last valid token's position.
    steps = jnp.where(tiles[:, _Q1] > tiles[:, _Q0],
                      pl.cdiv(jnp.maximum(tiles[:, _Q1] + tiles[:, _SHIFT], 0), block_kv), 0)
    tiles = tiles.at[:, _STEPS].set(steps)[jnp.argsort(-steps, stable=True)]
    num_items = num_tiles * num_heads
    num_ctas = min(num_ctas or _num_sms(interpret), num_items)
    num_rounds = pl.cdiv(num_items, num_ctas)
    if num_rounds * num_ctas > num_items:  # empty items (q0 = q1 = 0) for the last round's spare slots
        extra = pl.cdiv(num_rounds * num_ctas - num_items, num_heads)
        tiles = jnp.pad(tiles, ((0, extra), (0, 0)))
        num_tiles += extra

    def entry(tile_ref, q_ref, k_ref, v_ref, pt_ref, out_ref, edge_ref):
        transforms = (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))
        smem = [
            plgpu.SMEM((q_buffers, COMPUTE_WGS, block_q, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((max_steps, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((max_steps, block_kv, head_dim), dtype, transforms=transforms),
            plgpu.SMEM((COMPUTE_WGS, block_q, block_kv), dtype, transforms=transforms) if interpret else None,
        ]
        pl.run_scoped(
            lambda *scoped: _kernel(tile_ref, q_ref, k_ref, v_ref, pt_ref, out_ref, edge_ref, scoped, scale=scale,
                                    block_q=block_q, block_kv=block_kv, max_steps=max_steps,
                                    q_buffers=q_buffers, num_ctas=num_ctas, num_rounds=num_rounds,
                                    p_in_smem=bool(interpret)),
            smem,
            (plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=max_steps),  # K slot filled
             plgpu.Barrier(num_arrivals=pages_per_block, num_barriers=max_steps),  # V slot filled
             plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=q_buffers)),  # Q window loaded
            (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=max_steps),) * 2  # K / V slot free
            + (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=q_buffers),),  # Q buffer free
            plgpu.Barrier(num_arrivals=COMPUTE_WGS),  # tensor-core turn
            collective_axes="wg",
        )

    out, edges = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((padded_tokens, num_heads, head_dim), dtype),
                  jax.ShapeDtypeStruct((num_tiles, 2, ALIGN, num_heads, head_dim), dtype)),
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )(tiles, q, k_cache, v_cache, table)

    # Scatter the edge chunks' valid rows into place (2 x 8 rows per tile).
    q0, q1 = tiles[:, _Q0, None], tiles[:, _Q1, None]  # [num_tiles, 1]
    r = jnp.arange(ALIGN, dtype=jnp.int32)[None, :]
    first = q0 // ALIGN * ALIGN + r  # [num_tiles, 8]: chunk holding q0 (written when q0 % 8 != 0)
    last = (q1 - 1) // ALIGN * ALIGN + r  # chunk holding q1 - 1 (written when q1 % 8 != 0, chunk >= q0)
    use_first = (first >= q0) & (first < q1) & (q0 % ALIGN != 0)
    use_last = (last >= q0) & (last < q1) & (q1 % ALIGN != 0) & ((q1 - 1) // ALIGN * ALIGN >= q0)
    tok = jnp.stack([jnp.where(use_first, first, padded_tokens), jnp.where(use_last, last, padded_tokens)], 1)
    # the in-bounds rows are distinct (an edge chunk shared by two sequences' tiles is split between them by
    # use_first / use_last), the rest dropped: plain stores, not XLA's atomic compare-and-swap per element
    out = out.at[tok.reshape(-1)].set(edges.reshape(-1, num_heads, head_dim), mode="drop", unique_indices=True)
    return out[:num_tokens] if padded_tokens != num_tokens else out


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def default_blocks(head_dim: int) -> tuple[int, int, int]:
    """(block_q, block_kv, max_steps) within the 227 KB of SMEM. Head_dim <= 128: a K/V ring of
    2 x 128 rows, leaving room for two Q/O buffers of 2 x 64 rows (192 KB at head_dim 128; H100 sweep,
    persistent grid: 307/513/579 TFLOP/s at 1k/4k/16k tokens vs 293/502/579 with one Q buffer and 3
    ring slots). Head_dim 256: 2 x 64 rows (one Q buffer fits)."""
    return (64, 128, 2) if head_dim <= 128 else (64, 64, 2)


def check_supported(q, k_cache) -> str | None:
    """Why this kernel cannot take these shapes (None when it can)."""
    head_dim, page_size = q.shape[-1], k_cache.shape[1]
    _, block_kv, _ = default_blocks(head_dim)
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {q.dtype} (bf16/fp16 only)"
    if k_cache.dtype != q.dtype:  # FP8 pages would need a conversion pass between the TMA ring and the wgmmas
        return f"cache dtype {k_cache.dtype} (q's only: an FP8 cache goes to the Triton kernel)"
    if head_dim % 64:
        return f"head_dim {head_dim} (multiple of 64 only)"
    if block_kv % page_size or page_size % 8:
        return f"page_size {page_size} (a multiple of 8 dividing {block_kv})"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "max_steps", "q_buffers", "num_ctas",
                                             "min_query_len", "interpret"))
def ragged_prefill_attention_mgpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    query_start: jax.Array,
    seq_lens: jax.Array,
    page_table: jax.Array,
    *,
    scale: float | None = None,
    block_q: int | None = None,
    block_kv: int | None = None,
    max_steps: int | None = None,
    q_buffers: int | None = None,
    num_ctas: int | None = None,
    min_query_len: int = 0,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a flattened ragged batch of new tokens over a paged KV cache (Mosaic GPU).

    Arguments and result as `prefill_attention.ragged_prefill_attention`; `block_q` (rows per compute
    warpgroup, multiple of 64), `block_kv` (K/V rows per step, multiple of 64 and of the page size)
    and `max_steps` (K/V ring depth, >= 2) default to `default_blocks(head_dim)`; `num_ctas` (the
    persistent grid) defaults to the GPU's SM count. With
    `min_query_len` > 1 only sequences with at least that many new tokens are computed (fewer tiles
    launched); the other sequences' rows and the padding rows are then left unspecified (the
    runner fills them from the Triton kernel).
    """
    if is_fp8(k_cache.dtype):  # (before the argument checks, which would ask for its scales)
        raise ValueError("ragged_prefill_attention_mgpu does not read an FP8 cache (ragged_prefill_attention does)")
    _check_args(q, k_cache, v_cache, query_start, seq_lens, page_table)
    if (why := check_supported(q, k_cache)) is not None:
        raise ValueError(f"ragged_prefill_attention_mgpu does not support {why}")
    d_bq, d_bkv, d_steps = default_blocks(q.shape[-1])
    block_q, block_kv, max_steps = block_q or d_bq, block_kv or d_bkv, max_steps or d_steps
    if block_q % 64 or block_kv % 64 or block_kv % k_cache.shape[1] or max_steps < 2:
        raise ValueError(f"need block_q, block_kv multiples of 64 (block_kv of the page size) and max_steps >= 2: "
                         f"{block_q=} {block_kv=} {max_steps=}")
    if num_ctas is not None and num_ctas < 1:
        raise ValueError(f"num_ctas must be >= 1 or None (one per SM), got {num_ctas=}")
    q_bytes = COMPUTE_WGS * block_q * q.shape[-1] * q.dtype.itemsize
    ring_bytes = 2 * max_steps * block_kv * q.shape[-1] * q.dtype.itemsize
    if q_buffers is None:  # double-buffer the query window when the SMEM has room
        q_buffers = 2 if 2 * q_bytes + ring_bytes <= SMEM_BYTES else 1
    if q_buffers < 1 or q_buffers * q_bytes + ring_bytes > SMEM_BYTES:
        raise ValueError(f"{q_buffers=} query buffers and a K/V ring of {max_steps=} x {block_kv=} rows need "
                         f"{(q_buffers * q_bytes + ring_bytes) // 1024} KiB of SMEM (at most {SMEM_BYTES // 1024})")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _mgpu_call(q, k_cache, v_cache, query_start, seq_lens, page_table, scale=scale, block_q=block_q,
                      block_kv=block_kv, max_steps=max_steps, q_buffers=q_buffers, num_ctas=num_ctas,
                      min_query_len=min_query_len, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Reference: the same contract as the Triton kernel, so the same pure-jnp reference
# ----------------------------------------------------------------------------------------------
ragged_prefill_attention_mgpu_reference = ragged_prefill_attention_reference
