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

Block-FP8 weights (`scale`) come [N, K], as checkpoints store them: each program's rows of the weight are its dots'
M (wgmma takes M >= 64, which a tile of a few token rows is not), met by x's rows quantized to e4m3 per K tile, FP8
dots, each tile's product scaled by both (pallas_kernels/dense/fp8_tiles.py); the K tile divides the scale blocks'
height and the row block (128 for 128 x 128 blocks) their width. (Qwen3-8B's o on the H200: 9.7 / 10.5 us at 1 / 8
tokens, against 12.0 / 12.5 with the weight [K, N] and the tokens as M; docs/performance.md.)

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools
import math

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
    tile_scales,
    weight_dot_swapped,
)

MAX_TOKENS = 32


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _gemm_kernel(x_ref, w_ref, *refs, block_t: int, block_k: int, k_per_split: int,
                 scale_block: tuple[int, int] | None = None):
    # x_ref [T, K] (whole: the real rows are loaded masked); w_ref [K, block_n]: this program's column
    # block, all K rows (the split picks its range); o_ref [k_splits, T, N] fp32 (whole).
    # FP8 (scale_block (bk, bn)): w_ref [block_n, K], this program's rows of the [N, K] weight (K contiguous), whose
    # rows are each dot's M (fp8_tiles.weight_dot_swapped): the accumulator and o_ref [k_splits, N, T] transposed;
    # s_ref [K / bk, N / bn] float32 (whole), before o_ref.
    fp8 = scale_block is not None
    s_ref, o_ref = refs if fp8 else (None, *refs)
    tokens = x_ref.shape[0]
    block_n = w_ref.shape[0 if fp8 else 1]
    n, s = pl.program_id(0), pl.program_id(1)
    real = jnp.arange(block_t, dtype=jnp.int32) < tokens  # [block_t]
    rows = pl.ds(0, block_t)

    def body(kk, acc):  # acc [block_t, block_n] fp32 ([block_n, block_t] FP8)
        ks = pl.ds(s * k_per_split + kk * block_k, block_k)
        xk = plgpu.load(x_ref.at[rows, ks], mask=jnp.broadcast_to(real[:, None], (block_t, block_k)), other=0)
        if not fp8:
            return acc + plgpu.dot(xk, w_ref[ks, :])
        xk, xs = act_operand(xk)
        ws = tile_scales(s_ref, s * k_per_split + kk * block_k, n * block_n, block_n, scale_block)
        return acc + weight_dot_swapped(w_ref[:, ks], xk, xs, ws)

    shape = (block_n, block_t) if fp8 else (block_t, block_n)
    acc = jax.lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros(shape, jnp.float32))
    cols = pl.ds(n * block_n, block_n)
    if fp8:
        plgpu.store(o_ref.at[s, cols, rows], acc, mask=jnp.broadcast_to(real[None, :], shape))
    else:
        plgpu.store(o_ref.at[s, rows, cols], acc, mask=jnp.broadcast_to(real[:, None], shape))


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------
def _gemm_call(x, w, scale, *, block_n, block_k, k_splits, num_warps, num_stages, scale_block, interpret):
    tokens, k = x.shape
    fp8 = scale is not None
    n = w.shape[0 if fp8 else 1]
    block_t = max(16, 1 << (tokens - 1).bit_length())
    kernel = functools.partial(_gemm_kernel, block_t=block_t, block_k=block_k, k_per_split=k // k_splits,
                               scale_block=scale_block if fp8 else None)
    scales = [scale] if fp8 else []
    out = pl.pallas_call(
        kernel,
        grid=(n // block_n, k_splits),
        in_specs=[pl.no_block_spec, pl.BlockSpec((block_n, k), lambda i, s: (i, 0)) if fp8
                  else pl.BlockSpec((k, block_n), lambda i, s: (0, i)),
                  *[pl.no_block_spec] * len(scales)],
        out_specs=pl.no_block_spec,
        out_shape=jax.ShapeDtypeStruct((k_splits, n, tokens) if fp8 else (k_splits, tokens, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"skinny_gemm_n{block_n}_k{block_k}_s{k_splits}" + ("_fp8_nk" if fp8 else ""),
    )(x, w, *scales)
    out = out[0] if k_splits == 1 else out.sum(axis=0)
    return out.T if fp8 else out


def default_config(k: int, n: int, scale_block: tuple[int, int] | None = None) -> dict:
    """Launch parameters (block_n, block_k, k_splits, num_warps, num_stages) for a [K, N] weight (FP8: in blocks of
    `scale_block`, a column block inside one of them)."""
    # (K, N multiples of 16: tiles of 16 at least)
    block_n = pow2_divisor(n, 64) if scale_block is None else pow2_divisor(math.gcd(n, scale_block[1]), 128)
    block_k = tile_k(k, 128, scale_block)
    # enough programs for ~2 waves of 132 SMs; each split keeps >= 8 tiles to pipeline. FP8: ~1.5 waves (a Qwen3-8B
    # EAGLE-3 head's lm_head, 250 column blocks: 39.2 us unsplit vs 47.6 at 2 splits; its q|k|v, 48 blocks, 18.8 us at
    # 8 splits vs 22.2 at 4: fp8_skinny_heads_h200.json)
    most = 264 if scale_block is None else 198  # programs
    k_splits = 1
    while (n // block_n) * k_splits < most and k % (k_splits * 2 * block_k) == 0 and k // (k_splits * 2) >= 8 * block_k:
        k_splits *= 2
    # FP8: 8 warps (Qwen3-8B's o on the H200: 10.0 / 10.3 us at 1 / 8 tokens against 10.8 / 11.0 with 4)
    num_warps = 4 if scale_block is None else 8
    return {"block_n": block_n, "block_k": block_k, "k_splits": k_splits, "num_warps": num_warps, "num_stages": 4}


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "num_warps", "num_stages",
                                             "scale_block", "interpret"))
def skinny_gemm(x: jax.Array, w: jax.Array, scale: jax.Array | None = None, *,
                scale_block: tuple[int, int] | None = None, block_n: int | None = None, block_k: int | None = None,
                k_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                interpret: bool = False) -> jax.Array:
    """`x @ w` in float32 for a few token rows.

    Args:
      x: `[T, K]`, 1 <= T <= 32.
      w: `[K, N]`, same dtype; or, with `scale`, float8_e4m3fn `[N, K]` as checkpoints store it (K contiguous; each
        dot takes its rows as M: fp8_tiles.weight_dot_swapped); K and N multiples of 16.
      scale: a block-FP8 w's float32 scales [K / bk, N / bn], one per `scale_block` = (bk, bn) block of the [K, N]
        weight (block_k then divides bk, block_n divides bn); x meets it as e4m3 rows quantized per K tile
        (pallas_kernels/dense/fp8_tiles.py).
      block_n, block_k, k_splits, num_warps, num_stages: launch parameters; None: `default_config`.
        block_n must divide N, k_splits * block_k must divide K.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[T, N]` float32 (the caller adds, casts or reduces across devices).
    """
    scale_block = None if scale is None else tuple(scale_block or ())
    wkn = w if scale is None else w.T  # the [K, N] view, for the checks
    check_scale("w", wkn, scale, scale_block)
    launch = _launch(x, wkn, block_n, block_k, k_splits, num_warps, num_stages, scale_block)
    return _gemm_call(x, w, scale, **launch, scale_block=scale_block, interpret=interpret)


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
    if scale_block is not None and (scale_block[0] % block_k or scale_block[1] % block_n):
        raise ValueError(f"block_k={block_k} and block_n={block_n} must divide the FP8 scale blocks {scale_block}")
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
