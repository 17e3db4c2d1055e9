"""A decode step's attention front end in one kernel: the input RMSNorm, the q|k|v projection, q/k norm,
RoPE, and the new K/V rows written into the paged cache.

At decode the q|k|v projection is a matrix-vector product that streams the fused `[hidden, (H + 2 KVH) D]`
weight, and around it XLA runs the norm (a reduce fusion) and `qkv_rope_write` (one more kernel): three
launches per layer, each with its ramp-up and tail, and the projection's output making a round trip through
HBM. Here one program owns one head's `D` output columns (a q head, a k head or a v head) for a tile of
tokens: it recomputes the tokens' RMSNorm from x (x is a few KB next to the weights; the row sums of
squares as straight-line loads, all in flight at once), streams its `[hidden, D]` slab of the weight in
`block_k`-row tiles into two fp32 accumulators (the head's two rotate-half halves), then finishes the head
in registers: q heads are normed, rotated and stored; k heads normed, rotated and written to the cache slot
of each token; v heads written as they are. Split over K (`counters`), the last of a head's programs to finish sums
their fp32 partials in split order and finishes the head: the epilogue's norm and rotation need the whole product.

Numerics: the input norm and the projection are HF's (the normed input rounded to the activation dtype before
the weight multiply, the projection rounded before the q/k norm: the V rows match HF's bit for bit); the q/k
norm's weight multiply and RoPE run in fp32 with one rounding at the end, where HF rounds each product to bf16
(up to 1 ulp apart on some elements), bit-identical to the XLA projection + `qkv_rope.py` path it replaces.

Split-K counters must be zero on entry (a dirty counter leaves its head unfinished, silently); the step's
counters are made zero once and every launch leaves them zero, launches being ordered by the stream.

Prefetch (`prefetch=`, the layer's o projection weight; `KernelPolicy.prefetch_o`): extra programs on the launch's
idle SMs read the first part of another array into L2 (evict-last) while the heads stream (dense/prefetch.py).

Block-FP8 q|k|v weights (`wqkv_scale`) come [out, in], as checkpoints store them: e4m3 tiles of a head half's rows
met by the normed rows quantized to e4m3 per K tile, FP8 dots whose M is the weight's rows (wgmma's M >= 64), each
tile's product scaled by both (pallas_kernels/dense/fp8_tiles.py); the K tile divides the scale blocks' height (128
for 128 x 128 blocks, the bf16 default), so a head of 128 rows reads one scale per K tile and half.

FP8 KV cache (float8_e4m3fn, `k_scale` / `v_scale` per kv head): the k and v rows are quantized as they are written
(`common.quantize_kv`).

Scope: full rotate-half RoPE (rotary dim = head_dim), no gated queries, no q/k/v bias; head_dim a power of two
>= 32; `check_supported` says why not otherwise (the caller keeps the XLA projection + `qkv_rope_write`).

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import rms_inverse, rms_normed, tile_rows
from pallas_kernels.dense.fp8_tiles import (
    act_operand,
    check_scale,
    dequantize,
    fake_quant_rows,
    tile_k,
    tile_scales,
    weight_dot_swapped,
)
from pallas_kernels.dense.prefetch import WIDTH, prefetch_rows, prefetch_rows_count, prefetch_view
from pallas_kernels.dense.qkv_rope import qkv_rope_write_reference
from pallas_kernels.kv_fp8 import check_kv_scales, is_fp8, quantize_kv
from pallas_kernels.split_k import check_counters, sum_splits, take_ticket

MAX_TOKENS = 64  # one token tile holds the whole step: the weights are read once
ONE_WAVE = 132  # the H100's SMs
LAUNCH = {"num_warps": 8, "num_stages": 4}  # bf16 weights
FP8_LAUNCH = {"num_warps": 4, "num_stages": 3}  # block-FP8 weights in > 2 K splits (default_k_splits)
FP8_MAX_SPLITS, FP8_MIN_SPLIT_TILES = 8, 4


def _kernel(x_ref, n_ref, w_ref, cos_ref, sin_ref, slot_ref, qn_ref, kn_ref, _k_in, _v_in, *refs,
            block_k: int, k_splits: int, num_heads: int, num_kv_heads: int, eps: float, qk_norm: bool,
            interpret: bool, prefetch_programs: int = 0, prefetch_row_count: int = 0,
            prefetch_eviction: str = "evict_last", scale_block: tuple[int, int] | None = None,
            fp8_kv: bool = False):
    # x_ref [T, hidden] (whole: rows past T read as 0); n_ref [hidden]; w_ref [hidden, D]: this head's columns;
    # cos/sin [T, D]; slot_ref [T]; q_ref [T, H, D]; k_ref / v_ref [num_slots, KVH, D] (the caches, in place).
    # Split-K (k_splits > 1): part_ref [S, T, heads * D] fp32 partials; cnt_ref [>= heads] int32, zero on entry
    # and left zero: the split that arrives last at a head's counter sums the partials and finishes the head.
    # Prefetch (prefetch_programs > 0): pf_ref [rows, 256], the array read into L2; pf_out [programs] fp32 (unused).
    # FP8 w (scale_block (bk, bn)): w_ref [D, hidden], the head's rows of the [out, in] weight; s_ref
    # [hidden / bk, heads * D / bn] float32 (whole), the block scales of the [in, out] weight.
    # FP8 cache (fp8_kv): ks_ref, vs_ref [KVH] float32 (whole), its scales.
    refs = list(refs)
    if prefetch_programs:
        pf_out = refs.pop()
    _cnt_in = refs.pop(0) if k_splits > 1 else None
    pf_ref = refs.pop(0) if prefetch_programs else None
    s_ref = refs.pop(0) if scale_block is not None else None
    kv_scale_refs = (refs.pop(0), refs.pop(0)) if fp8_kv else (None, None)
    if k_splits > 1:
        q_ref, k_ref, v_ref, cnt_ref, part_ref = refs
    else:
        (q_ref, k_ref, v_ref), cnt_ref, part_ref = refs, None, None
    heads = num_heads + 2 * num_kv_heads
    h, split = pl.program_id(0), pl.program_id(1)  # (read here: the interpreter has no program ids in a branch)
    head = functools.partial(_head, x_ref, n_ref, w_ref, cos_ref, sin_ref, slot_ref, qn_ref, kn_ref, q_ref, k_ref,
                             v_ref, cnt_ref, part_ref, h, split, block_k=block_k, k_splits=k_splits,
                             num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps, qk_norm=qk_norm,
                             interpret=interpret, kv_scale_refs=kv_scale_refs,
                             **({} if scale_block is None else {"s_ref": s_ref, "scale_block": scale_block}))
    if not prefetch_programs:
        head()
        return
    pl.when(h < heads)(head)

    @pl.when(h >= heads)
    def _prefetch():
        prefetch_rows(pf_ref, pf_out, (h - heads) * k_splits + split, prefetch_programs, prefetch_row_count,
                      eviction=prefetch_eviction)


def _head(x_ref, n_ref, w_ref, cos_ref, sin_ref, slot_ref, qn_ref, kn_ref, q_ref, k_ref, v_ref, cnt_ref, part_ref,
          h, split, *,
          block_k: int, k_splits: int, num_heads: int, num_kv_heads: int, eps: float, qk_norm: bool,
          interpret: bool, kv_scale_refs, s_ref=None, scale_block: tuple[int, int] | None = None):
    """One (head, K split) program: the head's normed, projected, rotated rows (see the module doc)."""
    tokens, hidden = x_ref.shape
    fp8 = scale_block is not None
    head_dim = w_ref.shape[0 if fp8 else 1]  # (FP8: the head's rows of the [out, in] weight)
    half = head_dim // 2
    ks_ref, vs_ref = kv_scale_refs
    block_t = _block_t(tokens)
    f32, dtype = jnp.float32, x_ref.dtype
    rows, real, x_cols = tile_rows(x_ref, 0, block_t)  # one tile: the whole step
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    mask = jnp.broadcast_to(real[:, None], (block_t, half))
    inv = rms_inverse(x_cols, hidden, block_t, block_k, eps)  # [block_t]
    steps = hidden // k_splits // block_k

    def body(kk, carry):
        a1, a2 = carry  # [block_t, half] fp32 each: the head's two rotate-half halves ([half, block_t] FP8)
        cols = pl.ds((split * steps + kk) * block_k, block_k)
        xk = rms_normed(x_cols(cols, block_k), inv, n_ref[cols])
        if not fp8:
            return a1 + plgpu.dot(xk, w_ref[cols, lo]), a2 + plgpu.dot(xk, w_ref[cols, hi])
        k0 = (split * steps + kk) * block_k
        xk, xs = act_operand(xk)
        s1 = tile_scales(s_ref, k0, h * head_dim, half, scale_block)
        s2 = tile_scales(s_ref, k0, h * head_dim + half, half, scale_block)
        return (a1 + weight_dot_swapped(w_ref[lo, cols], xk, xs, s1),
                a2 + weight_dot_swapped(w_ref[hi, cols], xk, xs, s2))

    zeros = jnp.zeros((half, block_t) if fp8 else (block_t, half), f32)
    a1, a2 = jax.lax.fori_loop(0, steps, body, (zeros, zeros))
    if fp8:  # (the weight's rows were the dots' M: back to token rows for the epilogue)
        a1, a2 = a1.T, a2.T

    def finish(a1, a2):
        a1, a2 = a1.astype(dtype).astype(f32), a2.astype(dtype).astype(f32)  # the projection's output, rounded

        def norm_rope(w_ref_):
            x1, x2 = a1, a2
            if qk_norm:
                r = jax.lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / head_dim + eps)[:, None]
                x1 = (x1 * r).astype(dtype).astype(f32) * w_ref_[lo][None, :].astype(f32)
                x2 = (x2 * r).astype(dtype).astype(f32) * w_ref_[hi][None, :].astype(f32)
            cos1 = plgpu.load(cos_ref.at[rows, lo], mask=mask, other=0).astype(f32)
            cos2 = plgpu.load(cos_ref.at[rows, hi], mask=mask, other=0).astype(f32)
            sin1 = plgpu.load(sin_ref.at[rows, lo], mask=mask, other=0).astype(f32)
            sin2 = plgpu.load(sin_ref.at[rows, hi], mask=mask, other=0).astype(f32)
            return (x1 * cos1 - x2 * sin1).astype(dtype), (x2 * cos2 + x1 * sin2).astype(dtype)

        @pl.when(h < num_heads)
        def _q():
            o1, o2 = norm_rope(qn_ref)
            plgpu.store(q_ref.at[rows, h, lo], o1.astype(q_ref.dtype), mask=mask)
            plgpu.store(q_ref.at[rows, h, hi], o2.astype(q_ref.dtype), mask=mask)

        slots = plgpu.load(slot_ref.at[rows], mask=real, other=-1)  # [block_t]; < 0: padding, nothing written
        keep = jnp.broadcast_to((slots >= 0)[:, None], (block_t, half))
        # the rows' cache addresses as full index arrays (a scatter: each token row goes to its own slot)
        at = jnp.broadcast_to(jnp.maximum(slots, 0)[:, None], (block_t, half))
        col = jnp.broadcast_to(jnp.arange(half, dtype=jnp.int32)[None, :], (block_t, half))

        @pl.when((h >= num_heads) & (h < num_heads + num_kv_heads))
        def _k():
            o1, o2 = norm_rope(kn_ref)
            j = h - num_heads
            scale = None if ks_ref is None else ks_ref[j]
            plgpu.store(k_ref.at[at, j, col], quantize_kv(o1, scale, k_ref.dtype), mask=keep)
            plgpu.store(k_ref.at[at, j, col + half], quantize_kv(o2, scale, k_ref.dtype), mask=keep)

        @pl.when(h >= num_heads + num_kv_heads)
        def _v():
            j = h - num_heads - num_kv_heads
            scale = None if vs_ref is None else vs_ref[j]
            # (the projection rounded to the activation dtype first, as the K rows and the jnp path)
            plgpu.store(v_ref.at[at, j, col], quantize_kv(a1.astype(dtype), scale, v_ref.dtype), mask=keep)
            plgpu.store(v_ref.at[at, j, col + half], quantize_kv(a2.astype(dtype), scale, v_ref.dtype), mask=keep)

    if k_splits == 1:
        finish(a1, a2)
        return
    c1, c2 = pl.ds(h * head_dim, half), pl.ds(h * head_dim + half, half)
    plgpu.store(part_ref.at[split, rows, c1], a1, mask=mask)
    plgpu.store(part_ref.at[split, rows, c2], a2, mask=mask)
    ticket = take_ticket(cnt_ref, h, interpret)

    @pl.when(ticket == k_splits - 1)
    def _last():  # the splits' partials summed in split order (deterministic), read past L1 (volatile)
        b1 = sum_splits(part_ref, k_splits, lambda s_: (s_, rows, c1), mask)
        b2 = sum_splits(part_ref, k_splits, lambda s_: (s_, rows, c2), mask)
        cnt_ref[h] = 0  # left zero for the next call that shares the buffer
        finish(b1, b2)


def _block_t(tokens: int) -> int:
    return max(16, 1 << (tokens - 1).bit_length())


def check_supported(tokens: int, hidden: int, qkv_width: int, num_heads: int, num_kv_heads: int, head_dim: int,
                    rotary_dim: int) -> str | None:
    """Why the kernel cannot take these shapes, or None."""
    if tokens > MAX_TOKENS:
        return f"{tokens} tokens > {MAX_TOKENS}"
    if qkv_width != (num_heads + 2 * num_kv_heads) * head_dim:
        return f"q|k|v width {qkv_width} is not (heads + 2 kv heads) x head_dim"
    if head_dim < 32 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 32"
    if rotary_dim != head_dim:
        return f"partial RoPE (rotary dim {rotary_dim} of {head_dim})"
    if hidden % 64:
        return f"hidden {hidden} is not a multiple of 64"
    return None


def default_block_k(hidden: int, scale_block: tuple[int, int] | None = None) -> int:
    """128 (64 where hidden is not a multiple of 128); FP8: also a divisor of the scale blocks' height."""
    return tile_k(hidden, 128, scale_block)


def default_k_splits(heads: int, hidden: int, block_k: int, fp8: bool = False, tokens: int = 1) -> int:
    """The most K splits (1, 2, 4) that keep `heads x splits` programs within one wave of ONE_WAVE and each
    split a whole number of K tiles: a program streams a head's weight at a per-SM rate (~37 GB/s measured on
    the H100 for these Triton loops), so the 48 heads of Qwen3-4B alone reach ~1.8 TB/s.

    FP8 (`fp8`): up to FP8_MAX_SPLITS, past one wave, while each split keeps FP8_MIN_SPLIT_TILES K tiles and the fp32
    partials of `tokens` rows, written and read, stay within a quarter of the FP8 weight's bytes: a K tile's chain
    (quantize the normed rows, two e4m3 dots, rescale) bounds a program, and several programs an SM (4 warps,
    FP8_LAUNCH) hide it. Qwen3-8B on the H200 at 1 and 8 tokens: 15.2 / 16.0 us at 8 splits of 4 tiles against
    22.7 / 22.8 at 2 (8 warps, 4 stages) (dense_fp8_qkv_sweep_h200.json)."""
    splits = 1
    if fp8:
        while splits < FP8_MAX_SPLITS and hidden % (splits * 2 * block_k) == 0 \
                and hidden // (splits * 2 * block_k) >= FP8_MIN_SPLIT_TILES and splits * 2 * tokens * 32 <= hidden:
            splits *= 2
        return splits
    while heads * splits * 2 <= ONE_WAVE and hidden % (splits * 2 * block_k) == 0:
        splits *= 2
    return min(splits, 4)


def idle_programs(heads: int, k_splits: int, sms: int = ONE_WAVE) -> int:
    """Programs a one-wave launch of `heads x k_splits` leaves room for (whole rows of k_splits)."""
    return max(0, (sms - heads * k_splits) // k_splits * k_splits)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "block_k", "k_splits", "num_warps",
                                             "num_stages", "prefetch_programs", "prefetch_fraction",
                                             "prefetch_eviction", "scale_block", "interpret"))
def norm_qkv_rope_write(x: jax.Array, norm_weight: jax.Array, wqkv: jax.Array, cos: jax.Array, sin: jax.Array,
                        slot_mapping: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None,
                        k_cache: jax.Array, v_cache: jax.Array, counters: jax.Array | None = None, *, num_heads: int,
                        num_kv_heads: int, eps: float = 1e-6, block_k: int | None = None, k_splits: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None, prefetch: jax.Array | None = None,
                        prefetch_programs: int | None = None, prefetch_fraction: float = 1.0,
                        prefetch_eviction: str = "evict_last", wqkv_scale: jax.Array | None = None,
                        scale_block: tuple[int, int] | None = None, k_scale: jax.Array | None = None,
                        v_scale: jax.Array | None = None, interpret: bool = False
                        ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """x -> (q [T, H, D] normed and rotated, k_cache, v_cache with the new rows written, counters).

    x: [T, hidden] (the residual stream); norm_weight: [hidden] (the layer's input RMSNorm); wqkv:
    [hidden, (H + 2 KVH) * D] (q heads, then k heads, then v heads); cos/sin: [T, D] rotate-half tables;
    slot_mapping: int32 [T], < 0 for padding; q_norm/k_norm: [D] or both None; caches
    [num_pages, page_size, KVH, D] (aliased to the outputs: in place under jit with a donated cache).
    counters: int32 [>= H + 2 KVH], all zero, or None. With them the head's K range is split over `k_splits`
    programs (default `default_k_splits`) whose last to finish sums the partials and finishes the head; they are
    returned all zero again (aliased: pass them on to the next call). None: one program per head.
    num_warps / num_stages: default LAUNCH (FP8_LAUNCH for FP8 weights in more than 2 K splits).

    prefetch: an array the next kernels read (a decode step's o projection weight), or None. The launch leaves SMs
    idle (Qwen3-4B: 96 programs on 132 SMs) and the weight stream short of HBM's rate; `prefetch_programs` (default
    `idle_programs`) extra programs read it (its first `prefetch_fraction`) meanwhile, marked evict-last, so it is
    in L2 when its GEMM runs. prefetch_eviction: those loads' L2 policy, "evict_last" or "normal".

    wqkv_scale: a block-FP8 wqkv's float32 scales, one per `scale_block` = (bk, bn) block of [in, out] (block_k then
    divides bk); the float8_e4m3fn wqkv comes [(H + 2 KVH) * D, hidden], as checkpoints store it (each dot takes a
    head half's weight rows as M), and the normed rows meet it quantized to e4m3 per K tile (fp8_tiles.py). k_scale /
    v_scale: float32 [KVH] for a float8_e4m3fn cache, else None.
    """
    tokens, hidden = x.shape
    head_dim = k_cache.shape[-1]
    heads = num_heads + 2 * num_kv_heads
    fp8 = wqkv_scale is not None
    w_kn = wqkv.T if fp8 else wqkv  # (FP8 comes [out, in]: the [in, out] view for the checks)
    why = check_supported(tokens, hidden, w_kn.shape[1], num_heads, num_kv_heads, head_dim, cos.shape[-1])
    if why is not None:
        raise ValueError(why)
    if w_kn.shape[0] != hidden or norm_weight.shape != (hidden,) or k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"shapes disagree: {x.shape=} {norm_weight.shape=} {wqkv.shape=} {k_cache.shape=}")
    check_kv_scales(k_cache, k_scale, v_scale)
    fp8_kv = is_fp8(k_cache.dtype)
    scale_block = None if wqkv_scale is None else tuple(scale_block or ())
    check_scale("wqkv", w_kn, wqkv_scale, scale_block)
    block_k = default_block_k(hidden, scale_block) if block_k is None else block_k
    if scale_block is not None and scale_block[0] % block_k:
        raise ValueError(f"block_k={block_k} must divide the FP8 scale blocks' height {scale_block[0]}")
    if counters is None:
        k_splits = 1
    elif k_splits is None:
        k_splits = default_k_splits(heads, hidden, block_k, fp8, tokens)
    if hidden % (block_k * k_splits):
        raise ValueError(f"block_k {block_k} x k_splits {k_splits} must divide hidden {hidden}")
    launch = FP8_LAUNCH if fp8 and k_splits > 2 else LAUNCH  # (FP8 at 2 splits: 4 warps 26.5 vs 8 warps 22.7 us)
    num_warps = launch["num_warps"] if num_warps is None else num_warps
    num_stages = launch["num_stages"] if num_stages is None else num_stages
    if counters is not None:
        check_counters(counters, heads)
    qk_norm = q_norm is not None
    if not qk_norm:
        q_norm = k_norm = jnp.ones((head_dim,), x.dtype)
    cache_shape = k_cache.shape
    flat = (cache_shape[0] * cache_shape[1], num_kv_heads, head_dim)  # slot-major: a free reshape
    pf = None if prefetch is None else prefetch_view(prefetch)
    if prefetch is not None and pf is None:
        raise ValueError(f"prefetch must hold a multiple of {WIDTH} elements, got {prefetch.shape}")
    if pf is not None and prefetch_programs is None:
        prefetch_programs = idle_programs(heads, k_splits)
    prefetch_programs = 0 if pf is None else prefetch_programs
    if prefetch_programs % k_splits:
        raise ValueError(f"prefetch_programs {prefetch_programs} must be a multiple of k_splits {k_splits}")
    kernel = functools.partial(_kernel, block_k=block_k, k_splits=k_splits, num_heads=num_heads,
                               num_kv_heads=num_kv_heads, eps=eps, qk_norm=qk_norm, interpret=interpret,
                               prefetch_programs=prefetch_programs,
                               prefetch_row_count=0 if pf is None else prefetch_rows_count(pf, prefetch_fraction),
                               prefetch_eviction=prefetch_eviction, fp8_kv=fp8_kv,
                               **({} if scale_block is None else {"scale_block": scale_block}))
    whole = pl.no_block_spec
    outs = [
        jax.ShapeDtypeStruct((tokens, num_heads, head_dim), x.dtype),
        jax.ShapeDtypeStruct(flat, k_cache.dtype),
        jax.ShapeDtypeStruct(flat, v_cache.dtype),
    ]
    split_args = []
    if k_splits > 1:
        outs += [jax.ShapeDtypeStruct(counters.shape, jnp.int32),
                 jax.ShapeDtypeStruct((k_splits, tokens, heads * head_dim), jnp.float32)]
        split_args = [counters]
    pf_args = []
    if prefetch_programs:
        outs.append(jax.ShapeDtypeStruct((prefetch_programs,), jnp.float32))
        pf_args = [pf]
    scale_args = ([] if wqkv_scale is None else [wqkv_scale]) + ([k_scale, v_scale] if fp8_kv else [])
    res = pl.pallas_call(
        kernel,
        grid=(heads + prefetch_programs // k_splits, k_splits),
        in_specs=[
            whole,
            pl.BlockSpec((hidden,), lambda h, s: (0,)),
            # (prefetchers: unused)
            pl.BlockSpec((head_dim, hidden), lambda h, s: (jnp.minimum(h, heads - 1), 0)) if fp8 else
            pl.BlockSpec((hidden, head_dim), lambda h, s: (0, jnp.minimum(h, heads - 1))),
            whole, whole, whole,
            pl.BlockSpec((head_dim,), lambda h, s: (0,)),
            pl.BlockSpec((head_dim,), lambda h, s: (0,)),
            whole, whole, *([whole] * (len(split_args) + len(pf_args) + len(scale_args))),
        ],
        out_specs=[whole] * len(outs),
        out_shape=outs,
        input_output_aliases={8: 1, 9: 2, **({10: 3} if split_args else {})},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"norm_qkv_rope_write_k{block_k}_s{k_splits}" + (f"_pf{prefetch_programs}" if prefetch_programs else "")
        + ("_fp8_nk" if fp8 else "") + ("_kvfp8" if fp8_kv else ""),
    )(x, norm_weight, wqkv, cos, sin, slot_mapping.astype(jnp.int32), q_norm, k_norm, k_cache.reshape(flat),
      v_cache.reshape(flat), *split_args, *pf_args, *scale_args)
    q, k_out, v_out = res[:3]
    return q, k_out.reshape(cache_shape), v_out.reshape(cache_shape), res[3] if split_args else counters


def norm_qkv_rope_write_reference(x, norm_weight, wqkv, cos, sin, slot_mapping, q_norm, k_norm, k_cache, v_cache,
                                  counters=None, *, num_heads: int, num_kv_heads: int, eps: float = 1e-6,
                                  wqkv_scale=None, scale_block=None, block_k=None, k_scale=None, v_scale=None):
    """Plain jnp, the same contract: HF's RMSNorm, the projection rounded to x's dtype, then `qkv_rope_write`'s
    reference. An FP8 wqkv: dequantized to float32, the normed rows FP8-quantized per K tile as the kernel does
    (`fake_quant_rows`; block_k: the kernel's, default `default_block_k`)."""
    xf = x.astype(jnp.float32)
    h = norm_weight * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    if wqkv_scale is not None:
        wqkv = dequantize(wqkv, wqkv_scale, scale_block)
        h = fake_quant_rows(h, block_k or default_block_k(x.shape[1], scale_block))
    qkv = jnp.dot(h, wqkv, preferred_element_type=jnp.float32).astype(x.dtype)
    return (*qkv_rope_write_reference(qkv, cos, sin, slot_mapping, q_norm, k_norm, k_cache, v_cache, k_scale, v_scale,
                                      num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps), counters)
