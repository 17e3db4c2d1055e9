"""Block-FP8 skinny GEMM for decode, Mosaic GPU (Hopper: TMA + wgmma): `x @ w^T` for a few token rows.

The Triton FP8 decode kernels (skinny_gemm.py, fused_mlp.py, norm_qkv_rope.py) stream the weights at 1.1-2.9 TB/s
on an H200 against bf16's ~3.9: each program's K loop is one chain per tile (load, quantize the token rows, FP8 dot,
rescale) and Triton keeps few tiles in flight (docs/performance.md). Here a memory warpgroup streams the weight's
[block_n, block_k] e4m3 tiles and the token rows' [t_pad, block_k] tiles by TMA into a ring of `max_steps` SMEM
slots, independent of the compute warpgroup, which takes each slot as soon as it lands:

- The weight comes [N, K] (K contiguous), as checkpoints store it: its tile is the wgmma's A (M = block_n rows, a
  multiple of 64), and the token tile the B operand, transposed ([t_pad, block_k] in SMEM: K-major, as 8-bit wgmma
  operands must be), N = t_pad (8 or 16) columns.
- One weight scale per 128 x 128 block: each K step's product goes into a fresh accumulator, which is added to the
  running fp32 sum times that step's scalar weight scale (block_k = 128: one scale block a step), read from GMEM a
  step ahead.
- The token rows come quantized to e4m3 once, per token over all of K (`quantize_tokens`: a float32 scale per
  token, amax / 448), before the kernel; their scales multiply the output after it. (The Triton kernels quantize per
  token and 128 columns, in every program.) Or (`w8a16`) they stay bf16, no kernel before this one, and the compute
  warpgroup converts each e4m3 tile to bf16 in its registers, the wgmma's A from registers (as JAX's
  hopper_mixed_type_matmul_mgpu does for int8): a few conversions per weight byte against the quantization pass.
- Split-K (`k_splits`) puts enough CTAs in flight for narrow outputs: each writes its fp32 partial [N, t_pad]; the
  wrapper sums them, scales, transposes.

Refs (GMEM): x [t_pad, K] e4m3 (w8a16: bf16), w [N, K] e4m3, ws [K / 128, N / 128] float32 (read as scalars), out
[k_splits, N, t_pad] float32. Grid (N / block_n, k_splits), one compute warpgroup and one memory warpgroup per CTA.

Interpret mode (CPU): jax's Mosaic GPU interpreter runs the same code (tests), but for w8a16's converted tile, which
passes through SMEM there (the interpreter's wgmma takes SMEM operands only); exporting for CUDA checks the GPU
lowering (layouts, TMA legality, SMEM) on a machine without a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.dense.fp8_tiles import check_scale, dequantize, quantize_groups

MAX_TOKENS = 16
BLOCK_K = 128  # one 128 x 128 scale block a K step (and a 128-byte swizzle row of e4m3)


def quantize_tokens(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, K] -> (e4m3 [T, K], float32 [T]): each token row scaled by amax / 448 over all of K; zero rows stay
    zero (scale 0)."""
    q, scale = quantize_groups(x, x.shape[1])
    return q, scale[:, 0]


def _kernel(x_gmem, w_gmem, ws_gmem, out_gmem, out_smem, a_smem, *, block_n: int, k_per_split: int,
            max_steps: int, t_pad: int, w8a16: bool):
    # a_smem: None, or (w8a16 under the interpreter, whose wgmma takes SMEM operands only) [block_n, 128] bf16 that
    # the converted tile passes through
    n_idx, s_idx = lax.axis_index("n"), lax.axis_index("s")
    k_steps = k_per_split // BLOCK_K
    k_tile0 = s_idx * k_steps  # the split's first K tile (= scale row)
    scale_col = n_idx * block_n // 128
    tiles = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))  # e4m3: 128 bytes a row
    # bf16 token rows (w8a16): 256 bytes a row, two 128-byte swizzle tiles of 64 columns
    x_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)) if w8a16 else tiles

    last_tile = k_tile0 + k_steps - 1

    def compute_context(eval_pipeline):
        zeros = plgpu.layout_cast(jnp.full((block_n, t_pad), 0, jnp.float32), plgpu.Layout.WGMMA)
        total, _ = eval_pipeline((zeros, ws_gmem[k_tile0, scale_col]))
        out_smem[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[s_idx, pl.ds(n_idx * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    def body(idxs, w_smem, x_smem, carry):
        (k,) = idxs
        total, scale = carry
        # the next step's scale, loaded here (a GMEM scalar: its latency under this step's wgmma, not the next's)
        next_scale = ws_gmem[jnp.minimum(k_tile0 + k + 1, last_tile), scale_col]

        def tile(acc_ref):
            # w8a16: the e4m3 tile into registers as bf16 (via f16 and f32: no direct e4m3 -> bf16 before PTX 9.2)
            a = w_smem[...].astype(jnp.float32).astype(jnp.bfloat16) if w8a16 else w_smem
            if a_smem is not None:
                a_smem[...] = a
                plgpu.commit_smem()
                a = a_smem
            plgpu.wgmma(acc_ref, a, x_smem.transpose((1, 0)))
            return acc_ref[...]

        product = pl.run_scoped(tile, plgpu.ACC((block_n, t_pad), jnp.float32))
        return total + product * scale, next_scale

    pipeline = plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(k_steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((block_n, BLOCK_K), lambda k: (0, k), transforms=tiles, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((t_pad, BLOCK_K), lambda k: (0, k), transforms=x_tiles, memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=1,
        max_concurrent_steps=max_steps,
        compute_context=compute_context,
    )
    k0 = s_idx * k_per_split
    pipeline(w_gmem.at[pl.ds(n_idx * block_n, block_n), pl.ds(k0, k_per_split)],
             x_gmem.at[:, pl.ds(k0, k_per_split)])


def default_config(k: int, n: int, w8a16: bool = False) -> dict:
    """block_n (128: one scale block's width, the wgmma's two 64-row groups; w8a16: 64, the tile converted in
    registers is 64 values a thread then, 128 with its fp32 step), k_splits (enough CTAs for ~one wave of 132 SMs,
    each split >= 8 K steps) and max_steps (the ring: 6 slots of <= 18 KB). Reasoned, not yet measured
    (`bench_dense fp8_skinny` sweeps them)."""
    block_n = 64 if w8a16 else 128
    k_splits = 1
    while (n // block_n) * k_splits * 2 <= 132 * 1.25 and k % (k_splits * 2 * BLOCK_K) == 0 \
            and k // (k_splits * 2) >= 8 * BLOCK_K:
        k_splits *= 2
    return {"block_n": block_n, "k_splits": k_splits, "max_steps": 6}


@functools.partial(jax.jit, static_argnames=("scale_block", "block_n", "k_splits", "max_steps", "w8a16",
                                             "interpret"))
def fp8_gemv_mgpu(x: jax.Array, w: jax.Array, scale: jax.Array, *, scale_block: tuple[int, int] = (128, 128),
                  block_n: int | None = None, k_splits: int | None = None, max_steps: int | None = None,
                  w8a16: bool = False, interpret: bool = False) -> jax.Array:
    """`x @ dequant(w)^T` in float32 for 1..16 token rows.

    Args:
      x: [T, K] (bf16 / f32), 1 <= T <= 16.
      w: float8_e4m3fn [N, K], as checkpoints store it; N a multiple of block_n, K of 128.
      scale: float32 [K / 128, N / 128], one per 128 x 128 block of the [K, N] weight (value = w * scale).
      scale_block: must be (128, 128).
      block_n, k_splits, max_steps: launch parameters; None: `default_config`.
      w8a16: x stays bf16 (no quantization, no kernel before this one) and each e4m3 tile is converted to bf16 in
        the compute warpgroup's registers (the wgmma's A from registers); else x is quantized per token to e4m3.
      interpret: run the Mosaic GPU interpreter (CPU tests).

    Returns:
      [T, N] float32.
    """
    tokens, k = x.shape
    n = w.shape[0]
    if tuple(scale_block) != (BLOCK_K, 128):
        raise ValueError(f"fp8_gemv_mgpu takes 128 x 128 scale blocks, got {scale_block}")
    check_scale("w", w.T, scale, tuple(scale_block))
    if not 1 <= tokens <= MAX_TOKENS or w.shape[1] != k:
        raise ValueError(f"x must be [1..{MAX_TOKENS}, K] and w [N, K]: {x.shape=} {w.shape=}")
    cfg = default_config(k, n, w8a16)
    block_n, k_splits, max_steps = block_n or cfg["block_n"], k_splits or cfg["k_splits"], \
        max_steps or cfg["max_steps"]
    if block_n not in (64, 128) or n % block_n:
        raise ValueError(f"block_n={block_n} must be 64 or 128 (inside one 128-wide scale block) and divide N={n}")
    if k % (k_splits * BLOCK_K):
        raise ValueError(f"k_splits * 128 = {k_splits * BLOCK_K} must divide K={k}")
    t_pad = 8 if tokens <= 8 else 16
    if w8a16:
        xq, xs = x.astype(jnp.bfloat16), jnp.ones((tokens,), jnp.float32)
    else:
        xq, xs = quantize_tokens(x)
    xq = jnp.pad(xq, ((0, t_pad - tokens), (0, 0)))
    bf16_tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    a_staging = [plgpu.SMEM((block_n, BLOCK_K), jnp.bfloat16, transforms=bf16_tiles)] if w8a16 and interpret else []
    out = plgpu.kernel(
        lambda x_ref, w_ref, s_ref, o_ref: pl.run_scoped(
            lambda o_smem, *a_smem: _kernel(x_ref, w_ref, s_ref, o_ref, o_smem, a_smem[0] if a_smem else None,
                                            block_n=block_n, k_per_split=k // k_splits, max_steps=max_steps,
                                            t_pad=t_pad, w8a16=w8a16),
            plgpu.SMEM((block_n, t_pad), jnp.float32), *a_staging,
            collective_axes="wg",
        ),
        out_type=jax.ShapeDtypeStruct((k_splits, n, t_pad), jnp.float32),
        grid=(n // block_n, k_splits),
        grid_names=("n", "s"),
        num_threads=2,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"fp8_gemv_mgpu_n{block_n}_s{k_splits}_r{max_steps}" + ("_w8a16" if w8a16 else ""),
    )(xq, w, scale)
    return out.sum(axis=0)[:, :tokens].T * xs[:, None]


def fp8_gemv_reference(x: jax.Array, w: jax.Array, scale: jax.Array, w8a16: bool = False) -> jax.Array:
    """The same contract in jnp: the token rows quantized as the kernel's (`quantize_tokens`; w8a16: bf16), w
    dequantized, an fp32 product."""
    xq, xs = (x.astype(jnp.bfloat16), jnp.ones((x.shape[0],), jnp.float32)) if w8a16 else quantize_tokens(x)
    wd = dequantize(w.T, scale, (BLOCK_K, 128))  # [K, N] float32
    return jnp.dot(xq.astype(jnp.float32), wd, precision=jax.lax.Precision.HIGHEST) * xs[:, None]
