"""Block-FP8 GEMM for prefill-sized steps: `y = x @ w` on the FP8 tensor cores (w8a8), vLLM's / DeepSeek's scheme.

A block-FP8 weight is float8_e4m3fn values [K, N] with one float32 scale per (bk x bn) block. The activations are
quantized on the fly per token and `block_k` columns (`quantize_rows`: scale = amax / 448, DeepSeek's and vLLM's
`per_token_group_quant_fp8`; a jnp fusion XLA joins to whatever produced x, an RMSNorm or the SwiGLU). Then one
program owns an output tile [block_m, block_n] and walks K in `block_k` steps, each inside one weight scale block:

    acc += dot(xq tile [block_m, block_k], wq tile [block_k, block_n])  (e4m3 x e4m3 -> fp32 on the tensor cores)
           * x_scale[rows, kb][:, None] * w_scale[kb, column blocks]

(vLLM's `w8a8_block_fp8_matmul` design; the per-K-tile rescale in fp32 registers is also what keeps the FP8 MMA's
limited-precision accumulation to one tile.) Programs are ordered in groups of `group_m` row tiles so a group's
weight column tiles are reused from L2. Rows past M are masked (loaded as 0, never stored).

`w_up` (the MLP's gate|up): a second weight of the same shape read beside w, and the tile's SwiGLU
`silu(x @ w) * (x @ w_up)` is the output: the [M, 2I] intermediate never reaches HBM.

Output in `out_dtype` (the model's bf16). GPU backend: the Pallas Triton lowering (`tt.dot` of f8E4M3FN operands,
sm >= 89); the e4m3 dot's K tile must be >= 32 there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import pow2_divisor
from pallas_kernels.dense.fp8_tiles import FP8, FP8_MAX, check_scale, dequantize, tile_k, tile_scales

MIN_GPU_BLOCK_K = 32  # the e4m3 MMA's K


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _gemm_kernel(x_ref, xs_ref, w_ref, ws_ref, *refs, block_m: int, block_n: int, block_k: int, group_m: int,
                 scale_block: tuple[int, int], swiglu: bool, trans_w: bool):
    # x_ref [M, K] e4m3 (whole: this tile's rows loaded masked); xs_ref [K / block_k, M] float32 (whole): each row's
    # scale per K tile; w_ref [K, N] e4m3 (whole), or [N, K] (trans_w); ws_ref [K / bk, N / bn] float32 (whole);
    # swiglu: wu_ref / wus_ref the up weight and its scales alike (w_ref: gate); o_ref [M, N] (whole).
    wu_ref, wus_ref, o_ref = refs if swiglu else (None, None, *refs)
    m = x_ref.shape[0]
    n = o_ref.shape[1]
    num_m, num_n = pl.cdiv(m, block_m), n // block_n
    # Grouped order: group_m row tiles x every column tile, column-major inside the group (L2 reuse of w's tiles).
    pid = pl.program_id(0)
    width = group_m * num_n
    first_m = (pid // width) * group_m
    size_m = jnp.minimum(num_m - first_m, group_m)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    m0, n0 = pid_m * block_m, pid_n * block_n
    rows, cols = pl.ds(m0, block_m), pl.ds(n0, block_n)
    real = (m0 + jnp.arange(block_m, dtype=jnp.int32)) < m  # [block_m]
    x_mask = jnp.broadcast_to(real[:, None], (block_m, block_k))

    def tile(ref, ks):  # [block_k, block_n] of w (or [block_n, block_k] of a transposed w)
        return ref[cols, ks] if trans_w else ref[ks, cols]

    def body(kk, accs):
        k0 = kk * block_k
        ks = pl.ds(k0, block_k)
        # [block_m, block_k] e4m3; rows past M undefined (no `other`: Triton casts no constant to e4m3), which only
        # reaches their own output rows, never stored
        xk = plgpu.load(x_ref.at[rows, ks], mask=x_mask)
        xs = plgpu.load(xs_ref.at[kk, rows], mask=real, other=0.0)[:, None]  # [block_m, 1]
        out = [acc + plgpu.dot(xk, tile(wr, ks), trans_b=trans_w) * xs
               * tile_scales(sr, k0, n0, block_n, scale_block)
               for acc, wr, sr in zip(accs, (w_ref, wu_ref), (ws_ref, wus_ref), strict=False)]
        return tuple(out)

    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    accs = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body, (zeros, zeros) if swiglu else (zeros,))
    y = accs[0] * jax.nn.sigmoid(accs[0]) * accs[1] if swiglu else accs[0]
    plgpu.store(o_ref.at[rows, cols], y.astype(o_ref.dtype), mask=jnp.broadcast_to(real[:, None], y.shape))


# ----------------------------------------------------------------------------------------------
# Wrapper: grid
# ----------------------------------------------------------------------------------------------
def _gemm_call(xq, xs, w, ws, wu, wus, *, out_dtype, block_m, block_n, block_k, group_m, num_warps, num_stages,
               scale_block, trans_w, interpret):
    m = xq.shape[0]
    n = w.shape[0 if trans_w else 1]
    swiglu = wu is not None
    kernel = functools.partial(_gemm_kernel, block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                               scale_block=scale_block, swiglu=swiglu, trans_w=trans_w)
    operands = [xq, xs, w, ws, *((wu, wus) if swiglu else ())]
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(m, block_m) * (n // block_n),),
        in_specs=[pl.no_block_spec] * len(operands),
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"fp8_gemm_m{block_m}_n{block_n}_k{block_k}" + ("_swiglu" if swiglu else "") + ("_nk" if trans_w else ""),
    )(*operands)


def default_config(m: int, k: int, n: int, scale_block: tuple[int, int], swiglu: bool = False) -> dict:
    """Launch parameters for x [M, K] @ w [K, N] in blocks of `scale_block` (vLLM's block-FP8 defaults on H100 /
    H200: 128-wide N and K tiles; 64-row tiles up to 2k rows, where 128-row ones would leave SMs idle; 4 warps per
    64 rows; 3 stages of 16-32 KB)."""
    block_m = min(128 if m > 2048 else 64, max(16, 1 << max(0, (m - 1).bit_length())))
    return {"block_m": block_m, "block_n": pow2_divisor(n, 128), "block_k": tile_k(k, 128, scale_block),
            "group_m": 8, "num_warps": 8 if block_m >= 128 else 4, "num_stages": 3 if swiglu or block_m >= 128 else 4}


def check_supported(k: int, n: int, scale_block: tuple[int, int], gpu: bool = True) -> str | None:
    """None where the kernel takes a [K, N] weight in blocks of `scale_block`, else why not (the caller takes the jnp
    path): a K tile (<= 128, inside one scale block) of >= 16 rows (>= 32 compiled for the GPU: the e4m3 MMA's K);
    N a multiple of 16."""
    block_k = tile_k(k, 128, scale_block)
    if block_k < (MIN_GPU_BLOCK_K if gpu else 16):
        return f"K tile {block_k} for K={k} in scale blocks {scale_block} is too small"
    if n % 16:
        return f"N={n} is not a multiple of 16"
    return None


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def quantize_rows(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (e4m3 values [M, K], float32 scales [K / group, M]): each row's `group` columns scaled by their
    amax / 448 (an all-zero group: scale 0, values 0). The scales are transposed so a program loads its rows' scales
    of one K tile contiguously. (The same rounding as fp8_tiles.act_operand, the decode kernels' w8a8.)"""
    m, k = x.shape
    xg = x.astype(jnp.float32).reshape(m, k // group, group)
    amax = jnp.max(jnp.abs(xg), axis=-1)  # [M, K / group]
    live = amax > 0
    inv = jnp.where(live, FP8_MAX / jnp.where(live, amax, 1.0), 0.0)
    q = jnp.clip(xg * inv[..., None], -FP8_MAX, FP8_MAX).astype(FP8)
    return q.reshape(m, k), (amax / FP8_MAX).T


@functools.partial(jax.jit, static_argnames=("scale_block", "out_dtype", "block_m", "block_n", "block_k", "group_m",
                                             "num_warps", "num_stages", "w_transposed", "interpret"))
def fp8_gemm(x: jax.Array, w: jax.Array, w_scale: jax.Array, *, scale_block: tuple[int, int],
             w_up: jax.Array | None = None, w_up_scale: jax.Array | None = None, x_scale: jax.Array | None = None,
             out_dtype=None, block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
             group_m: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
             w_transposed: bool = False, interpret: bool = False) -> jax.Array:
    """`x @ w` for a block-FP8 w with x quantized to e4m3 per row and `block_k` columns; with `w_up`,
    `silu(x @ w) * (x @ w_up)`.

    Args:
      x: `[M, K]` in the model's dtype (quantized here, `quantize_rows`), or already e4m3 with `x_scale`
        `[K / block_k, M]`.
      w, w_up: `[K, N]` float8_e4m3fn (`[N, K]` where w_transposed), K and N multiples of 16.
      w_scale, w_up_scale: their float32 scales, one per `scale_block` = (bk, bn) block: `[K / bk, N / bn]`.
      out_dtype: the output's dtype; None: x's (bfloat16 where x is e4m3).
      block_m, block_n, block_k, group_m, num_warps, num_stages: launch parameters; None: `default_config`.
        block_n must divide N, block_k divide bk (a K tile inside one scale block) and K.
      w_transposed: w (and w_up) given as [N, K] (K contiguous: the e4m3 MMA's preferred B operand).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[M, N]` in out_dtype.
    """
    scale_block = tuple(scale_block)
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"x must be [M, K] and w [K, N]: {x.shape=} {w.shape=}")
    wkn = w.T if w_transposed else w  # (shape checks only)
    if x.shape[1] != wkn.shape[0]:
        raise ValueError(f"x [M, K] and w [K, N] must share K: {x.shape=} {w.shape=} ({w_transposed=})")
    check_scale("w", wkn, w_scale, scale_block)
    if (w_up is None) != (w_up_scale is None):
        raise ValueError("w_up goes with w_up_scale")
    if w_up is not None:
        if w_up.shape != w.shape:
            raise ValueError(f"w_up must be shaped as w: {w_up.shape=} {w.shape=}")
        check_scale("w_up", w_up.T if w_transposed else w_up, w_up_scale, scale_block)
    (m, k), n = x.shape, wkn.shape[1]
    if m < 1 or k % 16 or n % 16:
        raise ValueError(f"M >= 1 and K, N multiples of 16: {x.shape=} {wkn.shape=}")
    cfg = default_config(m, k, n, scale_block, w_up is not None)
    launch = {"block_m": block_m or cfg["block_m"], "block_n": block_n or cfg["block_n"],
              "block_k": block_k or cfg["block_k"], "group_m": group_m or cfg["group_m"],
              "num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}
    if n % launch["block_n"]:
        raise ValueError(f"block_n={launch['block_n']} must divide N={n}")
    if scale_block[0] % launch["block_k"] or k % launch["block_k"]:
        raise ValueError(f"block_k={launch['block_k']} must divide K={k} and the scale blocks' height {scale_block[0]}")
    if x_scale is None:
        if x.dtype == FP8:
            raise ValueError("an e4m3 x needs its x_scale")
        out_dtype = out_dtype or x.dtype
        x, x_scale = quantize_rows(x, launch["block_k"])
    elif x.dtype != FP8 or x_scale.shape != (k // launch["block_k"], m) or x_scale.dtype != jnp.float32:
        raise ValueError(f"x_scale goes with an e4m3 x: float32 [K / block_k, M] = {(k // launch['block_k'], m)}, "
                         f"got {x.dtype=} {x_scale.dtype} {x_scale.shape}")
    return _gemm_call(x, x_scale, w, w_scale, w_up, w_up_scale, out_dtype=out_dtype or jnp.bfloat16, **launch,
                      scale_block=scale_block, trans_w=w_transposed, interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale_block", "group", "out_dtype"))
def fp8_gemm_reference(x: jax.Array, w: jax.Array, w_scale: jax.Array, *, scale_block: tuple[int, int], group: int,
                       w_up: jax.Array | None = None, w_up_scale: jax.Array | None = None,
                       out_dtype=None) -> jax.Array:
    """The same in plain jnp and float32: x quantized as `quantize_rows` does (per `group` columns) and dequantized,
    w (and w_up) dequantized per block, an exact float32 matmul. (The e4m3 values pass an optimization barrier: XLA's
    GPU simplifier may otherwise drop an f32 -> e4m3 -> f32 round trip as excess precision.)"""
    m, k = x.shape
    xq, xs = jax.lax.optimization_barrier(quantize_rows(x, group))
    xf = (xq.astype(jnp.float32).reshape(m, k // group, group) * xs.T[..., None]).reshape(m, k)

    def mm(w, s):
        return jnp.dot(xf, dequantize(w, s, scale_block, jnp.float32), precision=jax.lax.Precision.HIGHEST)

    y = mm(w, w_scale)
    if w_up is not None:
        y = jax.nn.silu(y) * mm(w_up, w_up_scale)
    return y.astype(out_dtype or x.dtype)
