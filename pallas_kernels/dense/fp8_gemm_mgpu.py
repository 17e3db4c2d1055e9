"""Block-FP8 GEMM for prefill, Mosaic GPU (Hopper: TMA + e4m3 wgmma): `x @ dequant(w)^T` for many token rows.

Prefill with block-FP8 weights used to dequantize them for XLA's bf16 GEMM (an extra pass over every weight per
step, and bf16's tensor-core rate); a Triton w8a8 GEMM (vLLM's design) reached 137 TFLOP/s on an H200
(docs/performance.md). This kernel takes FP8 at the tensor cores' FP8 rate, as DeepGEMM does on Hopper: 1022-1155
TFLOP/s at Qwen3-8B's shapes and 4096 tokens on an H200, against 663-834 for XLA's bf16 GEMM.

- The activations come quantized to e4m3 once, per token and 128 columns (fp8_tiles.quantize_groups: amax / 448, as
  DeepSeek's, vLLM's and the Triton decode kernels' scheme; one scale a token over all of K let an outlier push the
  row's other values into e4m3's subnormals: 7.7% error against 2.6% at a 6e4 ratio), by an XLA fusion before the
  kernel; the weight comes [N, K] e4m3 (K contiguous, as checkpoints store it and `fp8.kernel_layout` keeps it),
  one float32 scale per 128 x 128 block.
- A persistent grid of one CTA per SM walks the output's [cta_m, cta_n] tiles (`plgpu.nd_loop`, `planar_snake` order
  for L2 reuse). Per tile, a memory warpgroup streams [cta_m, 128] token tiles and [cta_n, 128] weight tiles by TMA
  into a ring of `max_steps` SMEM slots (`emit_pipeline_warp_specialized`, as JAX's hopper_matmul_mgpu), and two
  compute warpgroups each own a [64, 128] part of the tile (`wg_dim` "m": the CTA tile is 128 x 128; "n": 64 x 256).
- A K step is 128 deep, one scale block: each warpgroup's wgmma (A the token rows, B the weight tile's K-major
  transposed view: both 8-bit operands K-major, as wgmma wants) goes into a fresh fp32 accumulator, which is added to
  the running sum times the step's weight scale (a scalar: a warpgroup's 128 columns are one scale block, read from
  GMEM a step ahead) and its rows' scales (a [64] vector the ring brings with the tiles, in the accumulator's row
  layout). Both warpgroups wait for the same slots, so their rescales tend to coincide, leaving the tensor
  cores idle meanwhile (~57% of FP8 peak). Making them issue their wgmmas in turn (two barriers, "ping-pong") was
  measured 11-12% slower at Qwen3-8B's shapes and 4096 tokens (dense_fp8_prefill_pingpong_h200.json) and removed.
- Epilogue: the sum cast to bf16, a TMA store from a staging buffer per warpgroup.
- Split-K (`k_splits`) for decode-sized steps, where the output has too few tiles to keep the SMs streaming weights:
  work items are (K split, tile), each split writes its float32 partial, and the wrapper's XLA fusion sums them.
- Grouped (`block_expert`, a mixture of experts' routed rows; pallas_kernels/moe/moe_fp8_mgpu.py): the rows come in
  blocks of 128 sorted by expert, each CTA tile reads its block's expert (a GMEM scalar) and that expert's weight and
  scales; unused blocks (-1) are skipped.

Registers bound the tile: a warpgroup holds its sum and one step's product, 2 x 64 fp32 values a thread for
[64, 128]; a [64, 256] part would need all 240 registers for those alone.

Refs (GMEM): x [M, K] e4m3, xs [K / 128, M] float32, w [N, K] e4m3, ws [K / 128, N / 128] float32 (read as scalars), out
[M, N] bf16 (split-K: [k_splits, M, N] float32); M a multiple of cta_m (the wrapper pads), N of cta_n, K of 128.
Grouped: w [E, N, K], ws [E, K / 128, N / 128], and be [M / 128] int32 before out.

Interpret mode (CPU): jax's Mosaic GPU interpreter runs the same code (tests); exporting for CUDA checks the GPU
lowering (layouts, TMA legality, SMEM) on a machine without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dense.fp8_tiles import check_scale, dequantize, fake_quant_rows, quantize_groups

BLOCK_K = 128  # one 128 x 128 scale block a K step (and a 128-byte swizzle row of e4m3)
WG_ROWS, WG_COLS = 64, 128  # a compute warpgroup's part of the output tile
SMEM_BYTES = 227 * 1024  # per CTA on Hopper
_H100_SMS = 132  # CTAs when lowering for CUDA on a machine without a GPU
_INTERPRET_CTAS = 4


def cta_tile(wg_dim: str) -> tuple[int, int]:
    """(rows, columns) of a CTA's output tile: the two compute warpgroups' [64, 128] parts side by side."""
    return (2 * WG_ROWS, WG_COLS) if wg_dim == "m" else (WG_ROWS, 2 * WG_COLS)


def _kernel(x_gmem, xs_gmem, w_gmem, ws_gmem, *refs, wg_dim: str, max_steps: int, grid_minor: int,
            grid_width: int, k_splits: int, grouped: bool):
    # xs_gmem [K / 128, M]: the rows' scales per 128 columns; grouped: refs = (be_gmem [M / cta_m] int32, out_gmem),
    # w_gmem [E, N, K], ws_gmem [E, K / 128, N / 128]
    be_gmem, out_gmem = refs if grouped else (None, *refs)
    m, k = x_gmem.shape
    n = w_gmem.shape[-2]
    cta_m, cta_n = cta_tile(wg_dim)
    m_iters, n_iters, k_iters = m // cta_m, n // cta_n, k // (BLOCK_K * k_splits)  # k_iters: K steps a split
    tiles = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))  # e4m3: 128 bytes a row
    swizzle_cols = 128 // jnp.dtype(out_gmem.dtype).itemsize  # a 128-byte swizzle row of the output
    out_tiles = (plgpu.TilingTransform((8, swizzle_cols)), plgpu.SwizzleTransform(128))

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((cta_m, BLOCK_K), lambda kk: (0, kk), transforms=tiles, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((cta_n, BLOCK_K), lambda kk: (0, kk), transforms=tiles, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((1, cta_m), lambda kk: (kk, 0), memory_space=plgpu.SMEM),  # the step's row scales
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=max_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the bodies)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0] if grouped else w_gmem, xs_gmem),
        out_smem=plgpu.SMEM((2, WG_ROWS, WG_COLS), out_gmem.dtype, transforms=out_tiles),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((k_splits * m_iters * n_iters,), collective_axes="cta")
        def _tiles(info):
            (item,) = info.index
            split, lin = lax.div(item, m_iters * n_iters), lax.rem(item, m_iters * n_iters)
            m_idx, n_idx = plgpu.planar_snake(lin, (m_iters, n_iters), grid_minor, grid_width)
            k_step0 = split * k_iters  # the split's first K step (= scale row)
            out_part = out_gmem.at[split] if k_splits > 1 else out_gmem
            wg_row = m_idx * cta_m + (wg * WG_ROWS if wg_dim == "m" else 0)
            wg_col = n_idx * cta_n + (wg * WG_COLS if wg_dim == "n" else 0)
            a_rows = pl.ds(wg * WG_ROWS, WG_ROWS) if wg_dim == "m" else pl.ds(0, WG_ROWS)
            b_rows = pl.ds(wg * WG_COLS, WG_COLS) if wg_dim == "n" else slice(None)
            scale_col = wg_col // 128
            expert = be_gmem[m_idx] if grouped else None  # (-1: an unused block, skipped)
            w_rows = w_gmem.at[jnp.maximum(expert, 0)] if grouped else w_gmem

            def w_scale(kk):
                return ws_gmem[expert, kk, scale_col] if grouped else ws_gmem[kk, scale_col]

            def compute_context(eval_pipeline):
                zeros = plgpu.layout_cast(jnp.full((WG_ROWS, WG_COLS), 0, jnp.float32), plgpu.Layout.WGMMA)
                total, _ = eval_pipeline((zeros, w_scale(k_step0)))
                out = total.astype(out_smem.dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous tile's store has read the buffer
                out_smem[wg] = out
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_part.at[pl.ds(wg_row, WG_ROWS), pl.ds(wg_col, WG_COLS)])

            def body(idxs, a_smem, b_smem, s_smem, carry):
                (kk,) = idxs
                next_scale = w_scale(k_step0 + jnp.minimum(kk + 1, k_iters - 1))  # (its latency under the wgmma)
                total, scale = carry

                def step(acc_ref):
                    plgpu.wgmma(acc_ref, a_smem.at[a_rows], b_smem.at[b_rows].transpose((1, 0)))
                    return acc_ref[...]

                product = pl.run_scoped(step, plgpu.ACC((WG_ROWS, WG_COLS), jnp.float32))
                rows = plgpu.load(s_smem.at[0, a_rows], layout=plgpu.Layout.WGMMA.reduce(1)) * scale  # [64]
                return total + product * lax.broadcast_in_dim(rows, product.shape, [0]), next_scale

            ks = pl.ds(k_step0 * BLOCK_K, k_iters * BLOCK_K)

            def run():
                pipeline(body, compute_context)(x_gmem.at[pl.ds(m_idx * cta_m, cta_m), ks],
                                                w_rows.at[pl.ds(n_idx * cta_n, cta_n), ks],
                                                xs_gmem.at[pl.ds(k_step0, k_iters), pl.ds(m_idx * cta_m, cta_m)],
                                                allocations=allocs)

            pl.when(expert >= 0)(run) if grouped else run()

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def smem_bytes(wg_dim: str, max_steps: int, out_dtype) -> int:
    """SMEM a CTA takes: the ring's slots (a token tile and a weight tile, e4m3, and the token rows' scales), the
    two output staging buffers, and 1 KB for the barriers and alignment."""
    cta_m, cta_n = cta_tile(wg_dim)
    staging = 2 * WG_ROWS * WG_COLS * jnp.dtype(out_dtype).itemsize
    return max_steps * ((cta_m + cta_n) * BLOCK_K + cta_m * 4) + staging + 1024


def default_config(m: int, n: int, k: int, num_sms: int = _H100_SMS) -> dict:
    """wg_dim ("m": 128 x 128 CTA tiles, a weight tile serving 128 rows), max_steps (the ring: 32 KB a slot), the
    grid's order (planar snake, `grid_width` tiles wide along the minor dimension) and k_splits.

    The sweep at Qwen3-8B's shapes and 4096 tokens (H200, dense_fp8_prefill_sweep_h200.json): "m" with 4 slots was the
    fastest or within 1% everywhere; 6 slots 1-3% slower, "n" 1-3% slower, the grid's order within 1%. With the rows
    scaled per 128 columns: 1115 / 1109 / 1130 / 1135 TFLOP/s for q|k|v / o / gate / down, 5 slots 3% slower
    (dense_fp8_prefill_pingpong_h200.json).

    k_splits: where the output has fewer tiles than half the SMs (decode-sized steps past fp8_max_tokens: Qwen3-8B's
    o and down have 32 tiles at up to 128 tokens, and such a step streams the weights), K is split in powers of two
    until the work items would pass the SMs, each split >= 4 K steps. Reasoned, not yet measured."""
    cfg = {"wg_dim": "m", "max_steps": 4, "grid_minor": 0, "grid_width": 8, "k_splits": 1}
    cta_m, cta_n = cta_tile(cfg["wg_dim"])
    tiles, k_steps = -(-m // cta_m) * (n // cta_n), k // BLOCK_K
    while tiles * cfg["k_splits"] * 2 <= num_sms and k_steps % (cfg["k_splits"] * 2) == 0 \
            and k_steps // (cfg["k_splits"] * 2) >= 4:
        cfg["k_splits"] *= 2
    return cfg


def _num_ctas(interpret: bool) -> int:
    if interpret:
        return _INTERPRET_CTAS
    try:
        dev = jax.devices()[0]
        return dev.core_count if dev.platform == "gpu" else _H100_SMS
    except RuntimeError:
        return _H100_SMS


@functools.partial(jax.jit, static_argnames=("scale_block", "wg_dim", "max_steps", "grid_minor", "grid_width",
                                             "k_splits", "out_dtype", "interpret"))
def fp8_gemm_mgpu(x: jax.Array, w: jax.Array, scale: jax.Array, block_expert: jax.Array | None = None, *,
                  scale_block: tuple[int, int] = (128, 128), wg_dim: str | None = None, max_steps: int | None = None,
                  grid_minor: int | None = None, grid_width: int | None = None, k_splits: int | None = None,
                  out_dtype=jnp.bfloat16, interpret: bool = False) -> jax.Array:
    """`x @ dequant(w)^T` with e4m3 tensor-core products and float32 accumulation, for prefill-sized token counts.

    Args:
      x: [T, K] (bf16 / f32); quantized to e4m3 here per token and 128 columns, T padded to the CTA tile's rows.
      w: float8_e4m3fn [N, K], as checkpoints store it; N a multiple of the CTA tile's columns, K of 128.
      scale: float32 [K / 128, N / 128], one per 128 x 128 block of the [K, N] weight (value = w * scale).
      block_expert: a grouped GEMM (mixture of experts): w [E, N, K] and scale [E, K / 128, N / 128] per expert, x's
        rows in blocks of 128 (the CTA tile's rows), block_expert [T / 128] int32 the expert of each (-1: unused,
        skipped; its output rows unspecified).
      scale_block: must be (128, 128).
      wg_dim, max_steps, grid_minor, grid_width, k_splits: launch parameters; None: `default_config`. With
        k_splits > 1 each split writes a float32 partial and an XLA fusion sums them.
      interpret: run the Mosaic GPU interpreter (CPU tests).

    Returns:
      [T, N] out_dtype.
    """
    tokens, k = x.shape
    n = w.shape[-2]
    grouped = block_expert is not None
    if tuple(scale_block) != (BLOCK_K, 128):
        raise ValueError(f"fp8_gemm_mgpu takes 128 x 128 scale blocks, got {scale_block}")
    if w.ndim != (3 if grouped else 2):
        raise ValueError(f"w must be [N, K], or [E, N, K] with block_expert: {w.shape=}")
    check_scale("w", jnp.swapaxes(w, -1, -2), scale, tuple(scale_block))
    if grouped and (wg_dim not in (None, "m") or (k_splits or 1) != 1 or block_expert.dtype != jnp.int32
                    or block_expert.shape != (tokens // cta_tile("m")[0],) or tokens % cta_tile("m")[0]):
        raise ValueError(f"a grouped GEMM takes rows in blocks of {cta_tile('m')[0]}, block_expert int32 one per block "
                         f"(got {block_expert.dtype} {block_expert.shape} for {tokens} rows), wg_dim 'm', no K split")
    num_ctas = _num_ctas(interpret)
    cfg = default_config(tokens, n, k, num_ctas)
    wg_dim = wg_dim or cfg["wg_dim"]
    max_steps = max_steps or cfg["max_steps"]
    grid_minor = cfg["grid_minor"] if grid_minor is None else grid_minor
    grid_width = grid_width or cfg["grid_width"]
    k_splits = 1 if grouped else k_splits or cfg["k_splits"]
    if wg_dim not in ("m", "n") or grid_minor not in (0, 1):
        raise ValueError(f"wg_dim={wg_dim!r} must be 'm' or 'n' and grid_minor={grid_minor!r} 0 or 1")
    cta_m, cta_n = cta_tile(wg_dim)
    if k % (k_splits * BLOCK_K):
        raise ValueError(f"k_splits * 128 = {k_splits * BLOCK_K} must divide K={k}")
    part_dtype = jnp.float32 if k_splits > 1 else out_dtype
    if w.shape[-1] != k or k % BLOCK_K or n % cta_n:
        raise ValueError(f"x [T, K] and w [N, K] need K % {BLOCK_K} == 0 and N % {cta_n} == 0: {x.shape=} {w.shape=}")
    if (need := smem_bytes(wg_dim, max_steps, part_dtype)) > SMEM_BYTES:
        raise ValueError(f"max_steps={max_steps} needs {need} bytes of SMEM a CTA ({wg_dim=}), over {SMEM_BYTES}")
    xq, xs = quantize_groups(x, BLOCK_K)  # e4m3 [T, K], float32 [T, K / 128]
    pad = -tokens % cta_m
    xq, xs = jnp.pad(xq, ((0, pad), (0, 0))), jnp.pad(xs, ((0, pad), (0, 0))).T  # xs [K / 128, T + pad]
    out = plgpu.kernel(
        functools.partial(_kernel, wg_dim=wg_dim, max_steps=max_steps, grid_minor=grid_minor, grid_width=grid_width,
                          k_splits=k_splits, grouped=grouped),
        out_type=jax.ShapeDtypeStruct((k_splits, tokens + pad, n) if k_splits > 1 else (tokens + pad, n), part_dtype),
        grid=(num_ctas,),
        grid_names=("cta",),
        num_threads=3,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"fp8_gemm_mgpu_{wg_dim}_r{max_steps}_s{k_splits}" + ("_grouped" if grouped else ""),
    )(xq, xs, w, scale, *(() if block_expert is None else (block_expert,)))
    return out[:, :tokens].sum(axis=0).astype(out_dtype) if k_splits > 1 else out[:tokens]


def fp8_gemm_reference(x: jax.Array, w: jax.Array, scale: jax.Array, block_expert: jax.Array | None = None,
                       out_dtype=jnp.bfloat16) -> jax.Array:
    """The same contract in jnp: the token rows quantized as the kernel's (per 128 columns, `fake_quant_rows`), w
    dequantized, an fp32 product (grouped: each block of 128 rows times its expert's weight; unused blocks' rows
    zero)."""
    xq = fake_quant_rows(x, BLOCK_K)  # [T, K] float32
    wd = dequantize(jnp.swapaxes(w, -1, -2), scale, (BLOCK_K, 128))  # [(E,) K, N] float32
    if block_expert is None:
        out = jnp.dot(xq, wd, precision=jax.lax.Precision.HIGHEST)
    else:
        rows = cta_tile("m")[0]
        xb = xq.reshape(-1, rows, xq.shape[1])
        out = jnp.einsum("bmk,bkn->bmn", xb, wd[jnp.maximum(block_expert, 0)], precision=jax.lax.Precision.HIGHEST)
        out = jnp.where((block_expert >= 0)[:, None, None], out, 0.0).reshape(x.shape[0], -1)
    return out.astype(out_dtype)
