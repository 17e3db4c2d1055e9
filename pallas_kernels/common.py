"""Constants and helpers the kernel modules share: power-of-two arithmetic, the base-2 softmax's constants, and
the RMSNorm prologue of a decode-sized token tile (Triton lowering). (The FP8 KV cache's quantization: kv_fp8.py.)"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)  # softmax in base 2: exp2 is one instruction
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: masked rows never make NaN


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def search_right(sorted_values: jax.Array, x: jax.Array) -> jax.Array:
    """`jnp.searchsorted(sorted_values, x, side="right")` as one compare-and-count fusion. The default method is a
    while loop of log2(n) iterations, which a GPU executable drives from the host (each iteration's kernels launched
    by it) and which cuts the step's command buffer in two; the bounds searched here (a batch's query starts, its
    tiles) are small."""
    return jnp.searchsorted(sorted_values, x, side="right", method="compare_all")


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


# ----------------------------------------------------------------------------------------------
# The RMSNorm prologue of a decode-sized tile (fused_mlp, norm_qkv_rope, moe_router)
# ----------------------------------------------------------------------------------------------
def tile_rows(x_ref, t, block_t: int):
    """Token tile t of x [tokens, hidden]: (its rows, which are real [block_t], `x_cols(cols, width)` loading
    [block_t, width] of x with the rows past `tokens` read as 0)."""
    rows = pl.ds(t * block_t, block_t)
    real = (t * block_t + jnp.arange(block_t, dtype=jnp.int32)) < x_ref.shape[0]  # [block_t]

    def x_cols(cols, width):
        return plgpu.load(x_ref.at[rows, cols], mask=jnp.broadcast_to(real[:, None], (block_t, width)), other=0)

    return rows, real, x_cols


def rms_inverse(x_cols, hidden: int, block_t: int, block_k: int, eps: float, unroll: bool = True) -> jax.Array:
    """1 / RMS of the tile's rows [block_t] (every program recomputes it: x is tiny next to the weights). Unrolled:
    straight-line code, the row's loads all in flight at once (one L2 round trip)."""
    def sumsq(kk, acc):
        xk = x_cols(pl.ds(kk * block_k, block_k), block_k).astype(jnp.float32)
        return acc + jnp.sum(xk * xk, axis=1)
    ss = jnp.zeros((block_t,), jnp.float32)
    if unroll:
        for kk in range(hidden // block_k):
            ss = sumsq(kk, ss)
    else:
        ss = jax.lax.fori_loop(0, hidden // block_k, sumsq, ss)
    return jax.lax.rsqrt(ss / hidden + eps)


def rms_normed(xk: jax.Array, inv: jax.Array, weight: jax.Array) -> jax.Array:
    """HF RMSNorm rounding: the normalized value in x's dtype, times the weight in that dtype."""
    return (xk.astype(jnp.float32) * inv[:, None]).astype(xk.dtype) * weight[None, :]
