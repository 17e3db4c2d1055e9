"""Block-FP8 weight tiles in the dense Triton kernels (fused MLP, skinny GEMM, norm + q|k|v + RoPE).

A block-FP8 weight is float8_e4m3fn values [K, N] and one float32 scale per (bk x bn) block of them (scale
[ceil(K / bk), ceil(N / bn)]): value = w * scale. A kernel loads the e4m3 tile (half the bytes of bf16), converts
it to the activation dtype in registers (exact: e4m3's values are all bf16 values), multiplies the token tile in
with fp32 accumulation, and scales the tile's fp32 product: one scale per K tile, so a K tile must sit inside one
scale block (`tile_k` picks a tile height dividing bk); the columns may span several blocks (a scale per column,
gathered) or sit inside one (one scalar scale). Whether a weight is FP8 is static: a kernel branches at trace time,
and its bf16 trace is the one it had before FP8 (same jaxpr).

Numerics: the product of the exact e4m3 values times the fp32 scale, where the jnp path (jinfer.models.fp8.dense)
rounds each dequantized weight to the activation dtype first; in float32 the two differ only in summation order.

Triton lowering (jax 0.11): an e4m3 load and `.astype(bf16 / f32)` lower to `tt.fp_to_fp` (sm >= 89).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import pow2_divisor

FP8 = jnp.float8_e4m3fn


def tile_k(dim: int, cap: int, block: tuple[int, int] | None) -> int:
    """The K tile: the largest power of two <= cap dividing `dim` and, for an FP8 weight, its scale blocks' height."""
    return pow2_divisor(dim if block is None else math.gcd(dim, block[0]), cap)


def check_scale(name: str, w: jax.Array, scale: jax.Array | None, block: tuple[int, int] | None) -> None:
    """ValueError unless `w` is float8_e4m3fn with scale [ceil(K / bk), ceil(N / bn)] float32 (or neither FP8 nor
    scaled)."""
    if scale is None:
        if w.dtype == FP8:
            raise ValueError(f"{name}: an FP8 weight needs its scales")
        return
    if w.dtype != FP8 or block is None or len(block) != 2:
        raise ValueError(f"{name}: scales go with a float8_e4m3fn weight and a scale block: {w.dtype=} {block=}")
    want = tuple(-(-d // b) for d, b in zip(w.shape[-2:], block, strict=True))
    if scale.shape != want or scale.dtype != jnp.float32:
        raise ValueError(f"{name}: scale must be float32 {want} for {w.shape} in blocks of {block}, "
                         f"got {scale.dtype} {scale.shape}")


def tile_scales(scale_ref, k0, n0, width: int, block: tuple[int, int]) -> jax.Array:
    """The scales of the weight tile whose first row is k0 (inside one scale block) and whose columns are
    [n0, n0 + width): [1, width] float32, or one scalar where n0 is a multiple of width and width divides bn."""
    bk, bn = block
    if bn % width == 0:  # the tile's columns sit inside one scale block (tiles start at multiples of their width)
        return scale_ref[k0 // bk, n0 // bn]
    cols = (n0 + jnp.arange(width, dtype=jnp.int32)) // bn
    return plgpu.load(scale_ref.at[k0 // bk, cols])[None, :]


def weight_dot(xk: jax.Array, w: jax.Array, scale_ref, k0, n0, block: tuple[int, int]) -> jax.Array:
    """xk [rows, tile_k] @ w [tile_k, width] in fp32 for an FP8 tile w whose first row is k0 and first column n0:
    w converted to xk's dtype, the product times the tile's scales (`tile_scales`)."""
    return plgpu.dot(xk, w.astype(xk.dtype)) * tile_scales(scale_ref, k0, n0, w.shape[1], block)


def dequantize(w: jax.Array, scale: jax.Array, block: tuple[int, int], dtype) -> jax.Array:
    """The references' weight: w [K, N] times its block scales in float32, rounded to `dtype` (what the jnp path,
    jinfer.models.fp8.dense, computes)."""
    k, n = w.shape
    s = jnp.repeat(jnp.repeat(scale, block[0], axis=0), block[1], axis=1)[:k, :n]
    return (w.astype(jnp.float32) * s).astype(dtype)
