"""Fused SwiGLU MLP: `(silu(x @ w_gate) * (x @ w_up)) @ w_down` without the intermediate in HBM.

One program owns (token tile, intermediate block): it computes the gate and up projections of its
`block_i` intermediate columns in fp32, forms `silu(gate) * up` in registers, and multiplies it
straight into `w_down`'s matching rows. The down projection sums over the intermediate dimension,
which is split across programs, so each program writes its `[block_t, hidden]` contribution as an
fp32 partial `[splits, T, hidden]` and XLA sums the `I / block_i` partials (deterministic). That
costs `splits * T * hidden * 4` bytes of traffic, so the kernel can only pay off for decode-sized
token counts. The token tile is padded to 16 rows in registers only: x's rows are loaded masked and
only the real rows of a partial are stored (a batch-1 step padded in HBM wrote and summed 16x the
partials it needed, 12 MB per Qwen3-4B layer against 149 MB of weights). The runner picks it per
token count from the measured table (benchmarks/results/kernels_*.json). (fp32 atomic adds into one `[T,
hidden]` buffer instead of
partials measured 1.6-10x slower on the H100; see kernels_h100_sweep_v0.json; summing the partials and adding the
residual in each column tile's last program measured slower at batch 1 too: XLA sums them.)

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import pow2_divisor, rms_inverse, rms_normed, tile_rows
from pallas_kernels.dense.fp8_tiles import (
    act_operand,
    check_scale,
    dequantize,
    fake_quant_rows,
    tile_k,
    weight_dot,
)


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _mlp_kernel(
    *refs,
    block_t: int,
    block_k: int,
    block_n: int,
    has_norm: bool,
    eps: float,
    unroll_norm: bool,
    scale_block: tuple[int, int] | None = None,
):
    refs = list(refs)
    n_ref = refs.pop(1) if has_norm else None
    sg_ref = su_ref = sd_ref = None
    if scale_block is not None:
        sg_ref, su_ref, sd_ref = refs[4:7]
        del refs[4:7]
    x_ref, wg_ref, wu_ref, wd_ref, o_ref = refs
    # x_ref [tokens, hidden] (whole; this tile's rows loaded masked); n_ref [hidden]: RMSNorm weight
    # applied to x first (optional); wg_ref/wu_ref [hidden, block_i]: this program's gate/up columns;
    # wd_ref [block_i, hidden]: the matching down-projection rows; o_ref [splits, tokens, hidden] fp32
    # (whole): this intermediate block's partial goes to o_ref[i, tile rows], real rows only.
    # FP8 weights (scale_block (bk, bn)): sg_ref / su_ref [hidden / bk, intermediate / bn], sd_ref
    # [intermediate / bk, hidden / bn] float32 (whole): the block scales (fp8_tiles.weight_dot).
    hidden = x_ref.shape[1]
    block_i = wg_ref.shape[1]
    t, i = pl.program_id(0), pl.program_id(1)
    rows, real, x_cols = tile_rows(x_ref, t, block_t)
    if has_norm:
        inv = rms_inverse(x_cols, hidden, block_t, block_k, eps, unroll_norm)  # [block_t]

    steps = hidden // block_k

    def up_body(kk, carry):
        g, u = carry  # [block_t, block_i] fp32 each
        cols = pl.ds(kk * block_k, block_k)
        xk = x_cols(cols, block_k)  # [block_t, block_k] (loading it a step ahead measured no faster)
        if has_norm:
            xk = rms_normed(xk, inv, n_ref[cols])
        if scale_block is None:
            return g + plgpu.dot(xk, wg_ref[cols, :]), u + plgpu.dot(xk, wu_ref[cols, :])
        xk, xs = act_operand(xk)  # e4m3 rows and their scales, once for gate and up
        g = g + weight_dot(xk, wg_ref[cols, :], sg_ref, kk * block_k, i * block_i, scale_block, xs)
        u = u + weight_dot(xk, wu_ref[cols, :], su_ref, kk * block_k, i * block_i, scale_block, xs)
        return g, u

    zeros = jnp.zeros((block_t, block_i), jnp.float32)
    g, u = jax.lax.fori_loop(0, steps, up_body, (zeros, zeros))
    h = g * jax.nn.sigmoid(g) * u  # [block_t, block_i] fp32, never leaves the SM
    hs = None
    if scale_block is None:
        h = h.astype(wd_ref.dtype)
    else:  # e4m3 with one scale per row (block_i divides the down weight's scale blocks' height)
        h, hs = act_operand(h)

    out_mask = jnp.broadcast_to(real[:, None], (block_t, block_n))
    n_blocks = hidden // block_n

    def down_body(n, _):
        cols = pl.ds(n * block_n, block_n)
        if scale_block is None:
            y = plgpu.dot(h, wd_ref[:, cols])  # [block_t, block_n] fp32
        else:
            y = weight_dot(h, wd_ref[:, cols], sd_ref, i * block_i, n * block_n, scale_block, hs)
        plgpu.store(o_ref.at[i, rows, cols], y, mask=out_mask)
        return 0

    jax.lax.fori_loop(0, n_blocks, down_body, 0)


# ----------------------------------------------------------------------------------------------
# Wrapper: grid and block specs
# ----------------------------------------------------------------------------------------------
def default_block_i(inter: int, scale_block: tuple[int, int] | None = None) -> int:
    """Intermediate columns per program: 128, the H100 sweep's best at Qwen3-4B's width (FP8: also a divisor of the
    scale blocks' height, as they are the down projection's K tile; 128 for 128 x 128 blocks)."""
    return tile_k(inter, 128, scale_block)


def _mlp_call(x, w_gate, w_up, w_down, norm_weight, scales, *, eps, block_t, block_i, num_warps, num_stages,
              unroll_norm, scale_block, interpret):
    tokens, hidden = x.shape
    inter = w_gate.shape[1]
    if block_t is None:
        block_t = min(64, max(16, 1 << (tokens - 1).bit_length()))
    if block_i is None:
        block_i = default_block_i(inter, scale_block)
    if num_warps is None:  # H100 sweep: 8 warps / 3 stages for decode tiles; bigger tiles run out of smem
        num_warps = 8 if block_t <= 16 else 4
    if num_stages is None:
        num_stages = 3 if block_t <= 16 else 2
    block_k = tile_k(hidden, 128, scale_block)  # FP8: a K tile inside one scale block
    block_n = pow2_divisor(hidden, 256)
    t_tiles, splits = pl.cdiv(tokens, block_t), inter // block_i
    has_norm = norm_weight is not None
    kernel = functools.partial(_mlp_kernel, block_t=block_t, block_k=block_k, block_n=block_n, has_norm=has_norm,
                               eps=eps, unroll_norm=unroll_norm, scale_block=scale_block)
    norm_spec = [pl.BlockSpec((hidden,), lambda t, i: (0,))] if has_norm else []
    whole = pl.no_block_spec  # x and the partials: the tile's rows are picked (masked) in the kernel
    out = pl.pallas_call(
        kernel,
        grid=(t_tiles, splits),
        in_specs=[
            whole,
            *norm_spec,
            pl.BlockSpec((hidden, block_i), lambda t, i: (0, i)),
            pl.BlockSpec((hidden, block_i), lambda t, i: (0, i)),
            pl.BlockSpec((block_i, hidden), lambda t, i: (i, 0)),
            *[whole] * len(scales),
        ],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((splits, tokens, hidden), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=(f"fused_swiglu_mlp_t{block_t}_i{block_i}" + ("_norm" if has_norm else "")
              + ("_fp8" if scales else "")),
    )(x, *([norm_weight] if has_norm else []), w_gate, w_up, w_down, *scales)
    return out.sum(axis=0).astype(x.dtype)  # [tokens, hidden]


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("eps", "block_t", "block_i", "num_warps", "num_stages", "unroll_norm",
                                             "scale_block", "interpret"))
def fused_swiglu_mlp(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    norm_weight: jax.Array | None = None,
    scales: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    *,
    scale_block: tuple[int, int] | None = None,
    eps: float = 1e-6,
    block_t: int | None = None,
    block_i: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    unroll_norm: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """SwiGLU MLP `(silu(x @ w_gate) * (x @ w_up)) @ w_down` with the intermediate kept on-chip.

    Args:
      x: `[tokens, hidden]`.
      w_gate, w_up: `[hidden, intermediate]`.
      w_down: `[intermediate, hidden]`.
      norm_weight: `[hidden]`: apply RMSNorm (HF rounding) to x first, inside the kernel; None: no norm.
      scales: block-FP8 weights (float8_e4m3fn w_gate, w_up, w_down): their float32 scales (gate, up, down), one per
        `scale_block` = (bk, bn) block of each [in, out] weight; the K tiles and block_i then divide bk. The normed x
        and the SwiGLU output meet them as e4m3 rows, quantized per K tile (pallas_kernels/dense/fp8_tiles.py).
        None: weights in x's dtype.
      eps: RMSNorm epsilon.
      block_t: tokens per tile (power of two >= 16); default min(64, next_pow2(tokens)).
      block_i: intermediate columns per program (power of two dividing intermediate, and bk for FP8); default 128.
      num_warps, num_stages: Triton launch parameters; None picks (8, 3) for block_t 16, else (4, 2).
      unroll_norm: the norm's sum of squares as straight-line code (all of the row's loads in flight at once)
        rather than a loop of hidden / 128 dependent round trips (51.6 vs 55.2 us per Qwen3.5-4B layer at
        T = 1 on the H100, decode_mlp_variants_h100.json).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[tokens, hidden]` in x's dtype (fp32 accumulation).
    """
    _check_args(x, w_gate, w_up, w_down, norm_weight, block_t, block_i)
    scales = tuple(scales or ())
    if scales or scale_block is not None:
        if len(scales) != 3:
            raise ValueError(f"scales must be (gate, up, down) scales with scale_block, got {len(scales)}")
        scale_block = tuple(scale_block or ())
        for name, w, s in zip(("w_gate", "w_up", "w_down"), (w_gate, w_up, w_down), scales, strict=True):
            check_scale(name, w, s, scale_block)
        if block_i is not None and scale_block[0] % block_i:
            raise ValueError(f"block_i={block_i} must divide the FP8 scale blocks' height {scale_block[0]}")
    else:
        for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            check_scale(name, w, None, None)
        scale_block = None
    return _mlp_call(x, w_gate, w_up, w_down, norm_weight, scales, eps=eps, block_t=block_t, block_i=block_i,
                     num_warps=num_warps, num_stages=num_stages, unroll_norm=unroll_norm, scale_block=scale_block,
                     interpret=interpret)


def _check_args(x, w_gate, w_up, w_down, norm_weight, block_t, block_i):
    if x.ndim != 2:
        raise ValueError(f"x must be [tokens, hidden], got {x.shape=}")
    hidden = x.shape[1]
    if w_gate.ndim != 2 or w_gate.shape[0] != hidden or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate/w_up must be [hidden, intermediate]: {w_gate.shape=} {w_up.shape=} "
                         f"{x.shape=}")
    if w_down.shape != (w_gate.shape[1], hidden):
        raise ValueError(f"w_down must be [intermediate, hidden]: {w_down.shape=} {w_gate.shape=}")
    if hidden % 16 or w_gate.shape[1] % 16:
        raise ValueError(f"hidden and intermediate must be multiples of 16: {w_gate.shape=}")
    if block_t is not None and (block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t=}")
    if block_i is not None and (block_i & (block_i - 1) or w_gate.shape[1] % block_i):
        raise ValueError(f"block_i must be a power of two dividing intermediate, got {block_i=}")
    if norm_weight is not None and norm_weight.shape != (hidden,):
        raise ValueError(f"norm_weight must be [hidden={hidden}], got {norm_weight.shape}")


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("eps", "scale_block"))
def fused_swiglu_mlp_reference(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                               norm_weight: jax.Array | None = None,
                               scales: tuple[jax.Array, jax.Array, jax.Array] | None = None, *,
                               scale_block: tuple[int, int] | None = None, eps: float = 1e-6) -> jax.Array:
    """Pure-jnp SwiGLU MLP (what XLA fuses on its own); fp32 accumulation, output in x's dtype. FP8 weights
    (`scales`): dequantized to float32, and the activations (normed x, h) FP8-quantized as the kernel does at its
    default tiles (`fake_quant_rows`)."""
    dtype = x.dtype
    if scales is not None:
        w_gate, w_up, w_down = (dequantize(w, s, scale_block)
                                for w, s in zip((w_gate, w_up, w_down), scales, strict=True))
    if norm_weight is not None:
        xf = x.astype(jnp.float32)
        x = norm_weight * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    if scales is not None:
        x = fake_quant_rows(x, tile_k(x.shape[1], 128, scale_block))
    g = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    u = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    h = jax.nn.silu(g) * u
    h = fake_quant_rows(h, default_block_i(h.shape[1], scale_block)) if scales is not None else h.astype(dtype)
    return jnp.dot(h, w_down, preferred_element_type=jnp.float32).astype(dtype)
