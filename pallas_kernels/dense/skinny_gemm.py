"""Skinny GEMM `x @ w` for decode-sized token counts (x `[T <= 32, K]`, w `[K, N]`): weight streaming.

At decode a projection is a matrix-vector product: the time is the weight's bytes over the bandwidth
the kernel reaches. XLA runs these as cuBLAS / Triton GEMMs tiled for large M, at 2.0-2.1 TB/s on the
H100 for Qwen3-4B's q|k|v and o (benchmarks/results/profile_latency_b1_qwen3-4b_h100_fused.trace.json.gz),
against ~3.0 TB/s the memory copies. Here one program owns (column block, K split): it walks its
`[K / k_splits, block_n]` slab of w in `block_k`-row tiles (Triton pipelines `num_stages` of them in
flight), multiplies the token tile (padded to 16 rows in registers, never in HBM) in, and stores the
real rows of its fp32 partial `[k_splits, T, N]`; XLA sums the splits (and fuses what follows: a
residual add, the cast). Splitting K puts enough programs in flight when N is narrow. (Summing the splits and adding
the residual in each column block's last program, and a no-split GEMV with the residual add, both measured no faster
than XLA's GEMM + add for Qwen3-4B's o at batch 1.)

Block-FP8 weights (`scale`): e4m3 tiles met by x's rows quantized to e4m3 per K tile, FP8 dots, each tile's product
scaled by both (pallas_kernels/dense/fp8_tiles.py); the K tile divides the scale blocks' height, and the column block
is 128 wide (a 128 x 128 scale block's tile: the bytes of bf16's 128 x 64 tile).

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import pow2_divisor
from pallas_kernels.dense.fp8_tiles import (
    act_operand,
    check_scale,
    dequantize,
    fake_quant_rows,
    tile_k,
    weight_dot,
)

MAX_TOKENS = 32


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _gemm_kernel(x_ref, w_ref, *refs, block_t: int, block_k: int, k_per_split: int,
                 scale_block: tuple[int, int] | None = None, trans_w: bool = False):
    # x_ref [T, K] (whole: the real rows are loaded masked); w_ref [K, block_n]: this program's column
    # block, all K rows (the split picks its range); o_ref [k_splits, T, N] fp32 (whole).
    # FP8 (scale_block (bk, bn)): s_ref [K / bk, N / bn] float32 (whole), before o_ref. trans_w: w_ref [block_n, K],
    # this program's rows of a transposed [N, K] weight (K contiguous).
    s_ref, o_ref = refs if scale_block is not None else (None, *refs)
    tokens = x_ref.shape[0]
    block_n = w_ref.shape[0 if trans_w else 1]
    n, s = pl.program_id(0), pl.program_id(1)
    real = jnp.arange(block_t, dtype=jnp.int32) < tokens  # [block_t]
    rows = pl.ds(0, block_t)

    def body(kk, acc):  # acc [block_t, block_n] fp32
        ks = pl.ds(s * k_per_split + kk * block_k, block_k)
        xk = plgpu.load(x_ref.at[rows, ks], mask=jnp.broadcast_to(real[:, None], (block_t, block_k)), other=0)
        if scale_block is None:
            return acc + plgpu.dot(xk, w_ref[ks, :])
        xk, xs = act_operand(xk)
        wk = w_ref[:, ks] if trans_w else w_ref[ks, :]
        return acc + weight_dot(xk, wk, s_ref, s * k_per_split + kk * block_k, n * block_n, scale_block, xs, trans_w)

    acc = jax.lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_t, block_n), jnp.float32))
    cols = pl.ds(n * block_n, block_n)
    plgpu.store(o_ref.at[s, rows, cols], acc, mask=jnp.broadcast_to(real[:, None], (block_t, block_n)))


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------
def _gemm_call(x, w, scale, *, block_n, block_k, k_splits, num_warps, num_stages, scale_block, trans_w=False,
               interpret):
    tokens, k = x.shape
    n = w.shape[0 if trans_w else 1]
    block_t = max(16, 1 << (tokens - 1).bit_length())
    kernel = functools.partial(_gemm_kernel, block_t=block_t, block_k=block_k, k_per_split=k // k_splits,
                               **({} if scale is None else {"scale_block": scale_block, "trans_w": trans_w}))
    scales = [] if scale is None else [scale]
    out = pl.pallas_call(
        kernel,
        grid=(n // block_n, k_splits),
        in_specs=[pl.no_block_spec, pl.BlockSpec((block_n, k), lambda i, s: (i, 0)) if trans_w
                  else pl.BlockSpec((k, block_n), lambda i, s: (0, i)),
                  *[pl.no_block_spec] * len(scales)],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((k_splits, tokens, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=(f"skinny_gemm_n{block_n}_k{block_k}_s{k_splits}"
              + ("_fp8" + ("_nk" if trans_w else "") if scales else "")),
    )(x, w, *scales)
    return out[0] if k_splits == 1 else out.sum(axis=0)


def default_config(k: int, n: int, scale_block: tuple[int, int] | None = None) -> dict:
    """Launch parameters (block_n, block_k, k_splits, num_warps, num_stages) for a [K, N] weight (FP8: in blocks of
    `scale_block`)."""
    block_n = pow2_divisor(n, 64 if scale_block is None else 128)  # (K, N multiples of 16: tiles of 16 at least)
    block_k = tile_k(k, 128, scale_block)
    # enough programs for ~2 waves of 132 SMs; each split keeps >= 8 tiles to pipeline
    k_splits = 1
    while (n // block_n) * k_splits < 264 and k % (k_splits * 2 * block_k) == 0 and k // (k_splits * 2) >= 8 * block_k:
        k_splits *= 2
    return {"block_n": block_n, "block_k": block_k, "k_splits": k_splits, "num_warps": 4, "num_stages": 4}


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "num_warps", "num_stages",
                                             "scale_block", "w_transposed", "interpret"))
def skinny_gemm(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *,
                scale_block: tuple[int, int] | None = None, block_n: int | None = None, block_k: int | None = None,
                k_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                w_transposed: bool = False, interpret: bool = False) -> jax.Array:
    """`x @ w` in float32 for a few token rows.

    Args:
      x: `[T, K]`, 1 <= T <= 32.
      w: `[K, N]`, same dtype, or float8_e4m3fn with `scale`; K and N multiples of 16.
      scale: a block-FP8 w's float32 scales, one per `scale_block` = (bk, bn) block (block_k then divides bk); x then
        meets it as e4m3 rows quantized per K tile (pallas_kernels/dense/fp8_tiles.py).
      block_n, block_k, k_splits, num_warps, num_stages: launch parameters; None: `default_config`.
        block_n must divide N, k_splits * block_k must divide K.
      w_transposed: an FP8 w given as its transpose [N, K] (K contiguous; scale still [K / bk, N / bn]).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[T, N]` float32 (the caller adds, casts or reduces across devices).
    """
    scale_block = None if scale is None else tuple(scale_block or ())
    if w_transposed and scale is None:
        raise ValueError("w_transposed is for FP8 weights")
    wkn = w.T if w_transposed else w  # (shape checks only)
    check_scale("w", wkn, scale, scale_block)
    launch = _launch(x, wkn, block_n, block_k, k_splits, num_warps, num_stages, scale_block)
    return _gemm_call(x, w, scale, **launch, scale_block=scale_block, trans_w=w_transposed, interpret=interpret)


def _launch(x, w, block_n, block_k, k_splits, num_warps, num_stages, scale_block=None) -> dict:
    """The checked launch parameters (None: `default_config`)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x must be [T, K] and w [K, N]: {x.shape=} {w.shape=}")
    tokens, k = x.shape
    n = w.shape[1]
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"skinny_gemm takes 1..{MAX_TOKENS} token rows, got {tokens=}")
    if k % 16 or n % 16:
        raise ValueError(f"K and N must be multiples of 16: {w.shape=}")
    cfg = default_config(k, n, scale_block)
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    k_splits = k_splits or cfg["k_splits"]
    if n % block_n:
        raise ValueError(f"block_n={block_n} must divide N={n}")
    if k % (k_splits * block_k):
        raise ValueError(f"k_splits * block_k = {k_splits} * {block_k} must divide K={k}")
    if scale_block is not None and scale_block[0] % block_k:
        raise ValueError(f"block_k={block_k} must divide the FP8 scale blocks' height {scale_block[0]}")
    return {"block_n": block_n, "block_k": block_k, "k_splits": k_splits,
            "num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("scale_block", "block_k"))
def skinny_gemm_reference(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *,
                          scale_block: tuple[int, int] | None = None, block_k: int | None = None) -> jax.Array:
    """What XLA does on its own (the batch-1 row padded to two, as `ops.project` does). An FP8 w: dequantized to
    float32, x FP8-quantized per row and K tile as the kernel does (`fake_quant_rows`; block_k: the kernel's,
    default `default_config`'s)."""
    if scale is not None:
        x = fake_quant_rows(x, block_k or default_config(*w.shape, scale_block)["block_k"])
        w = dequantize(w, scale, scale_block)
    if x.shape[0] == 1:
        return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w, preferred_element_type=jnp.float32)[:1]
    return jnp.dot(x, w, preferred_element_type=jnp.float32)
