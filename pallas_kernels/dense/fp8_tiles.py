"""Block-FP8 weight tiles in the Triton kernels (fused MLP, skinny GEMM, norm + q|k|v + RoPE, MoE grouped GEMMs).

The dense decode kernels (fused MLP, skinny GEMM, norm + q|k|v) take their weights [out, in], as checkpoints store
them, and multiply weight tile @ activations^T (`weight_dot_swapped`): the weight's rows are the dot's M, which
Hopper's wgmma (M >= 64 a warpgroup) takes; the MoE grouped GEMMs keep the token tile as M and take the [out, in]
tile as the dot's transposed, K-major right side (`weight_dot`).

A block-FP8 weight is float8_e4m3fn values [K, N] and one float32 scale per (bk x bn) block of them (scale
[ceil(K / bk), ceil(N / bn)]): value = w * scale. A kernel loads the e4m3 tile (half the bytes of bf16) and meets it
with e4m3 activations: the token tile's rows quantized over the K tile's columns (`act_operand`: a float32 scale per
row, amax / 448), so the dot runs on the FP8 tensor cores with fp32 accumulation, and the tile's product is scaled
by the rows' scales and the weight block's. One weight scale per K tile, so a K tile must sit inside one scale block
(`tile_k` picks a tile height dividing bk; 128 for 128 x 128 blocks: one activation scale per row and 128 columns,
DeepSeek's / vLLM's / HF transformers' dynamic per-token-group activation scheme); the columns may span several
blocks (a scale per column, gathered) or sit inside one (one scalar scale). Whether a weight is FP8 is static: a
kernel branches at trace time, and its bf16 trace is the one it had before FP8 (same jaxpr).

Numerics: the activations' e4m3 rounding (3 mantissa bits) is the difference from the jnp path
(jinfer.models.fp8.dense: each weight dequantized to the activation dtype, then XLA's dot), which the dense layers
of large steps run. The kernels' references model it (`fake_quant_rows` + `dequantize`): the same FP8 values, another
summation order. (Converting the e4m3 tile to bf16 in registers against bf16 activations made Qwen3-8B's decode
steps slower, though not each kernel, and f16 dots were slower: docs/performance.md, "Variants measured slower".)

Triton lowering (jax 0.11): an e4m3 load, the activations' `.astype(e4m3)` and the e4m3 x e4m3 dot need sm >= 89.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import pow2_divisor

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0


def tile_k(dim: int, cap: int, block: tuple[int, int] | None) -> int:
    """The K tile: the largest power of two <= cap dividing `dim` and, for an FP8 weight, its scale blocks' height."""
    return pow2_divisor(dim if block is None else math.gcd(dim, block[0]), cap)


def check_scale(name: str, w: jax.Array, scale: jax.Array | None, block: tuple[int, int] | None) -> None:
    """ValueError unless `w` [..., K, N] is float8_e4m3fn with scale [..., ceil(K / bk), ceil(N / bn)] float32 (or
    neither FP8 nor scaled)."""
    if scale is None:
        if w.dtype == FP8:
            raise ValueError(f"{name}: an FP8 weight needs its scales")
        return
    if w.dtype != FP8 or block is None or len(block) != 2:
        raise ValueError(f"{name}: scales go with a float8_e4m3fn weight and a scale block: {w.dtype=} {block=}")
    want = (*w.shape[:-2], *(-(-d // b) for d, b in zip(w.shape[-2:], block, strict=True)))
    if scale.shape != want or scale.dtype != jnp.float32:
        raise ValueError(f"{name}: scale must be float32 {want} for {w.shape} in blocks of {block}, "
                         f"got {scale.dtype} {scale.shape}")


def tile_scales(scale_ref, k0, n0, width: int, block: tuple[int, int], lead: tuple = ()) -> jax.Array:
    """The scales of the weight tile whose first row is k0 (inside one scale block) and whose columns are
    [n0, n0 + width): [1, width] float32, or one scalar where n0 is a multiple of width and width divides bn.
    `lead`: indices of scale_ref's leading axes (a stacked expert weight's expert)."""
    bk, bn = block
    if bn % width == 0:  # the tile's columns sit inside one scale block (tiles start at multiples of their width)
        return scale_ref[(*lead, k0 // bk, n0 // bn)]
    cols = (n0 + jnp.arange(width, dtype=jnp.int32)) // bn
    return plgpu.load(scale_ref.at[(*lead, k0 // bk, cols)])[None, :]


def act_operand(xk: jax.Array, axis: int = 1) -> tuple[jax.Array, jax.Array]:
    """The activation tile [rows, k] as the FP8 dot (`weight_dot`) takes it: (e4m3 xk, its float32 scales [rows, 1]),
    each row scaled by amax / 448 over the tile's k columns (the K tile sits inside one weight scale block, so a row's
    scale is one per 128-column group where the tile is 128 wide). Zero rows (masked padding) stay zero. axis=0: a
    transposed tile [k, rows] (`weight_dot_swapped`'s), scales [1, rows]."""
    xf = xk.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axis, keepdims=True)  # [rows, 1] ([1, rows] for axis 0)
    live = amax > 0
    inv = jnp.where(live, FP8_MAX / jnp.where(live, amax, 1.0), 1.0)
    return (xf * inv).astype(FP8), jnp.where(live, amax / FP8_MAX, 0.0)


def weight_dot(xk: jax.Array, w: jax.Array, scale_ref, k0, n0, block: tuple[int, int], x_scale: jax.Array,
               lead: tuple = ()) -> jax.Array:
    """xk [rows, tile_k] @ w^T in fp32 for an FP8 tile w [width, tile_k] of an [N, K] weight (K contiguous: the
    K-major operand 8-bit dots want) whose first column is k0 and first row n0, (xk, x_scale) from `act_operand`:
    e4m3 times e4m3 on the FP8 tensor cores, the product scaled by the rows' `x_scale`, then by the tile's weight
    scales (`tile_scales` of the [K, N] blocks; `lead`: their leading indices)."""
    out = plgpu.dot(xk, w, trans_b=True) * x_scale
    return out * tile_scales(scale_ref, k0, n0, w.shape[0], block, lead)


def weight_dot_swapped(w: jax.Array, xk: jax.Array, x_scale: jax.Array, w_scale: jax.Array,
                       xk_transposed: bool = False) -> jax.Array:
    """The transposed product (xk @ w^T)^T = w @ xk^T in fp32, [width, rows], for an FP8 tile w [width, tile_k] of a
    transposed [N, K] weight (K contiguous, as checkpoints store it), w_scale its scales from `tile_scales` (a scalar,
    or [1, width] where the tile's rows span several scale blocks): the weight's rows are the dot's M, so Hopper's
    wgmma (M >= 64 a warpgroup) takes the e4m3 dot that a tile of a few token rows as M cannot. xk: e4m3
    [rows, tile_k] with x_scale [rows, 1] (`act_operand`), or xk_transposed [tile_k, rows] with x_scale [1, rows]
    (`act_operand(axis=0)`)."""
    out = plgpu.dot(w, xk, trans_b=not xk_transposed)
    return out * (x_scale if xk_transposed else x_scale.T) * (w_scale.T if w_scale.ndim == 2 else w_scale)


def quantize_groups(x: jax.Array, group: int) -> tuple[jax.Array, jax.Array]:
    """x [T, K] as e4m3 per row and `group` columns, as `act_operand` quantizes a tile: (e4m3 [T, K], float32 scales
    [T, K / group], amax / 448); zero groups stay zero (scale 0)."""
    t, k = x.shape
    xg = x.astype(jnp.float32).reshape(t, k // group, group)
    amax = jnp.max(jnp.abs(xg), axis=-1, keepdims=True)
    live = amax > 0
    q = (xg * jnp.where(live, FP8_MAX / jnp.where(live, amax, 1.0), 1.0)).astype(FP8)
    return q.reshape(t, k), jnp.where(live, amax / FP8_MAX, 0.0)[..., 0]


def fake_quant_rows(x: jax.Array, group: int) -> jax.Array:
    """The references' activations: x [T, K] as the FP8 dot sees it (`act_operand` per `group` columns: the kernel's
    K tile), in float32."""
    t, k = x.shape
    q, scale = quantize_groups(x, group)
    # the barrier: XLA's GPU pipeline folds convert(convert(x, e4m3), f32) back to x (excess precision allowed)
    q = jax.lax.optimization_barrier(q).astype(jnp.float32).reshape(t, k // group, group)
    return (q * scale[..., None]).reshape(t, k)


def dequantize(w: jax.Array, scale: jax.Array, block: tuple[int, int]) -> jax.Array:
    """The references' weight: w [..., K, N] times its block scales, in float32 (against `fake_quant_rows`'
    activations; the jnp path, jinfer.models.fp8.dense, rounds it to the activation dtype)."""
    *_, k, n = w.shape
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)[..., :k, :n]
    return w.astype(jnp.float32) * s
