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

Block-FP8 weights come [out, in], as checkpoints store them (`_mlp_kernel_fp8`): each dot is a weight tile @ the
e4m3 activations^T, the weight's 128 rows as M, which Hopper's wgmma takes and a 16-row token tile as M does not.
Qwen3-8B's MLP at one token on the H200: 59 us a layer (2.6 TB/s on the FP8 bytes), against 100 us with the weights
[in, out] and the tokens as M, and 76 us for bf16 (docs/performance.md).

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools
import math

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
    weight_dot_swapped,
)


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _mlp_kernel(*refs, block_t: int, block_k: int, block_n: int, has_norm: bool, eps: float, unroll_norm: bool):
    refs = list(refs)
    n_ref = refs.pop(1) if has_norm else None
    x_ref, wg_ref, wu_ref, wd_ref, o_ref = refs
    # x_ref [tokens, hidden] (whole; this tile's rows loaded masked); n_ref [hidden]: RMSNorm weight
    # applied to x first (optional); wg_ref/wu_ref [hidden, block_i]: this program's gate/up columns;
    # wd_ref [block_i, hidden]: the matching down-projection rows; o_ref [splits, tokens, hidden] fp32
    # (whole): this intermediate block's partial goes to o_ref[i, tile rows], real rows only.
    hidden = x_ref.shape[1]
    block_i = wg_ref.shape[1]
    t, i = pl.program_id(0), pl.program_id(1)
    rows, real, x_cols = tile_rows(x_ref, t, block_t)
    if has_norm:
        inv = rms_inverse(x_cols, hidden, block_t, block_k, eps, unroll_norm)  # [block_t]

    def up_body(kk, carry):
        g, u = carry  # [block_t, block_i] fp32 each
        cols = pl.ds(kk * block_k, block_k)
        xk = x_cols(cols, block_k)  # [block_t, block_k] (loading it a step ahead measured no faster)
        if has_norm:
            xk = rms_normed(xk, inv, n_ref[cols])
        return g + plgpu.dot(xk, wg_ref[cols, :]), u + plgpu.dot(xk, wu_ref[cols, :])

    zeros = jnp.zeros((block_t, block_i), jnp.float32)
    g, u = jax.lax.fori_loop(0, hidden // block_k, up_body, (zeros, zeros))
    h = (g * jax.nn.sigmoid(g) * u).astype(wd_ref.dtype)  # [block_t, block_i], never leaves the SM
    out_mask = jnp.broadcast_to(real[:, None], (block_t, block_n))

    def down_body(n, _):
        cols = pl.ds(n * block_n, block_n)
        plgpu.store(o_ref.at[i, rows, cols], plgpu.dot(h, wd_ref[:, cols]), mask=out_mask)  # [block_t, block_n]
        return 0

    jax.lax.fori_loop(0, hidden // block_n, down_body, 0)


def _mlp_kernel_fp8(*refs, block_t: int, block_k: int, block_n: int, has_norm: bool, eps: float,
                        unroll_norm: bool, scale_block: tuple[int, int], tiles_per_step: int = 1):
    """Block-FP8 weights as checkpoints store them, [out, in]: wg_ref / wu_ref [block_i, hidden] (this program's rows
    of [intermediate, hidden]), wd_ref [hidden, block_i] (its columns of [hidden, intermediate]); every dot is weight
    rows @ activations^T (fp8_tiles.weight_dot_swapped), so gate / up / h are [block_i, block_t] and the partial
    o_ref [splits, hidden, tokens] (whole) is transposed. sg_ref / su_ref [hidden / bk, intermediate / bn], sd_ref
    [intermediate / bk, hidden / bn] float32 (whole): the scales of the [in, out] weights' blocks, one per tile
    (block_i and block_n divide bn, block_k and block_i divide bk). Each loop step takes `tiles_per_step` K tiles
    (up) / row blocks (down), and loads the next step's activations and scales (carried), off the dots' critical
    path."""
    refs = list(refs)
    n_ref = refs.pop(1) if has_norm else None
    x_ref, wg_ref, wu_ref, wd_ref, sg_ref, su_ref, sd_ref, o_ref = refs
    hidden = x_ref.shape[1]
    block_i = wg_ref.shape[0]
    bk, bn = scale_block
    per = tiles_per_step
    t, i = pl.program_id(0), pl.program_id(1)
    rows, real, x_cols = tile_rows(x_ref, t, block_t)
    if has_norm:
        inv = rms_inverse(x_cols, hidden, block_t, block_k, eps, unroll_norm)
    steps = hidden // (block_k * per)

    def up_operands(kk):  # K tile kk's activations (raw, and the norm weight) and the gate / up tiles' scales
        cols = pl.ds(kk * block_k, block_k)
        norm = n_ref[cols] if has_norm else None
        kb, nb = kk * block_k // bk, i * block_i // bn
        return x_cols(cols, block_k), norm, sg_ref[kb, nb], su_ref[kb, nb]

    def step_operands(st):
        st = jnp.minimum(st, steps - 1)
        return tuple(v for j in range(per) for v in up_operands(st * per + j))

    def up_body(st, carry):
        g, u, *ops = carry  # g, u [block_i, block_t] fp32 each
        nxt = step_operands(st + 1)
        for j in range(per):
            xk, norm, sg, su = ops[4 * j:4 * j + 4]
            if has_norm:
                xk = rms_normed(xk, inv, norm)
            xk, xs = act_operand(xk)
            cols = pl.ds((st * per + j) * block_k, block_k)
            g = g + weight_dot_swapped(wg_ref[:, cols], xk, xs, sg)
            u = u + weight_dot_swapped(wu_ref[:, cols], xk, xs, su)
        return g, u, *nxt

    zeros = jnp.zeros((block_i, block_t), jnp.float32)
    g, u, *_ = jax.lax.fori_loop(0, steps, up_body, (zeros, zeros, *step_operands(0)))
    h, hs = act_operand(g * jax.nn.sigmoid(g) * u, axis=0)  # e4m3 [block_i, block_t], a scale per token column
    out_mask = jnp.broadcast_to(real[None, :], (block_n, block_t))
    n_steps = hidden // (block_n * per)

    def down_scales(st):
        st = jnp.minimum(st, n_steps - 1)
        return tuple(sd_ref[i * block_i // bk, (st * per + j) * block_n // bn] for j in range(per))

    def down_body(st, sds):
        nxt = down_scales(st + 1)
        for j in range(per):
            cols = pl.ds((st * per + j) * block_n, block_n)
            y = weight_dot_swapped(wd_ref[cols, :], h, hs, sds[j], xk_transposed=True)  # [block_n, block_t]
            plgpu.store(o_ref.at[i, cols, rows], y, mask=out_mask)
        return nxt

    jax.lax.fori_loop(0, n_steps, down_body, down_scales(0))


# ----------------------------------------------------------------------------------------------
# Wrapper: grid and block specs
# ----------------------------------------------------------------------------------------------
def default_block_i(inter: int, scale_block: tuple[int, int] | None = None) -> int:
    """Intermediate columns per program: 128, the H100 sweep's best at Qwen3-4B's width (FP8: a divisor of the scale
    blocks' height and width too, a tile's rows inside one block; 128 for 128 x 128 blocks)."""
    return pow2_divisor(inter if scale_block is None else math.gcd(inter, *scale_block), 128)


def narrow_block_i(inter: int, min_programs: int = 64) -> int:
    """Intermediate columns per program for a narrow bf16 MLP (a MoE layer's shared experts): `default_block_i`'s 128
    halved down to 32 while the grid would have fewer than `min_programs` programs. Each program's K loop is serial,
    so a few programs cannot stream the weights: DeepSeek-V2-Lite's 2048 x 2816 at one token on the H200 took 19.3 us
    at 32 (88 programs), 19.5 at 64 and 26.0 at 128 (22), 8 warps (decode_mlp_shared_h200.json)."""
    block = default_block_i(inter)
    while block > 32 and inter // block < min_programs:
        block //= 2
    return block


def _fp8_tiles(hidden: int, scale_block: tuple[int, int]) -> tuple[int, int]:
    """(block_k, block_n) of the FP8 kernel: a K tile, and a down row block, inside one scale block."""
    return tile_k(hidden, 128, scale_block), pow2_divisor(math.gcd(hidden, scale_block[1]), 256)


def fits_tiles_per_step(hidden: int, scale_block: tuple[int, int], tiles_per_step: int) -> bool:
    """Whether the FP8 kernel's loops can take `tiles_per_step` K tiles / row blocks a step at this width."""
    return all(hidden % (b * tiles_per_step) == 0 for b in _fp8_tiles(hidden, scale_block))


def _mlp_call(x, w_gate, w_up, w_down, norm_weight, scales, *, eps, block_t, block_i, num_warps, num_stages,
              unroll_norm, scale_block, tiles_per_step, interpret):
    tokens, hidden = x.shape
    fp8 = bool(scales)
    inter = w_gate.shape[0 if fp8 else 1]
    if block_t is None:
        block_t = min(64, max(16, 1 << (tokens - 1).bit_length()))
    if block_i is None:
        block_i = default_block_i(inter, scale_block)
    if num_warps is None:  # H100 sweep: 8 warps / 3 stages for decode tiles; bigger tiles run out of smem
        num_warps = 8 if block_t <= 16 else 4
    if num_stages is None:  # (FP8, H200: 4 stages at 1 and 8 tokens, decode_mlp_fp8_swap_h200.json)
        num_stages = (4 if fp8 else 3) if block_t <= 16 else 2
    block_k, block_n = _fp8_tiles(hidden, scale_block) if fp8 else (tile_k(hidden, 128, None),
                                                                     pow2_divisor(hidden, 256))
    t_tiles, splits = pl.cdiv(tokens, block_t), inter // block_i
    has_norm = norm_weight is not None
    kernel = functools.partial(_mlp_kernel_fp8 if fp8 else _mlp_kernel, block_t=block_t, block_k=block_k,
                               block_n=block_n, has_norm=has_norm, eps=eps, unroll_norm=unroll_norm,
                               **({"scale_block": scale_block, "tiles_per_step": tiles_per_step} if fp8 else {}))
    norm_spec = [pl.BlockSpec((hidden,), lambda t, i: (0,))] if has_norm else []
    whole = pl.no_block_spec  # x and the partials: the tile's rows are picked (masked) in the kernel
    rows_i = pl.BlockSpec((block_i, hidden), lambda t, i: (i, 0))
    cols_i = pl.BlockSpec((hidden, block_i), lambda t, i: (0, i))
    out = pl.pallas_call(
        kernel,
        grid=(t_tiles, splits),
        in_specs=[whole, *norm_spec, *((rows_i, rows_i, cols_i) if fp8 else (cols_i, cols_i, rows_i)),
                  *[whole] * len(scales)],
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((splits, hidden, tokens) if fp8 else (splits, tokens, hidden), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=(f"fused_swiglu_mlp_t{block_t}_i{block_i}" + ("_norm" if has_norm else "")
              + (f"_fp8_nk{tiles_per_step}" if fp8 else "")),
    )(x, *([norm_weight] if has_norm else []), w_gate, w_up, w_down, *scales)
    out = out.sum(axis=0)
    return (out.T if fp8 else out).astype(x.dtype)  # [tokens, hidden]


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("eps", "block_t", "block_i", "num_warps", "num_stages", "unroll_norm",
                                             "scale_block", "tiles_per_step", "interpret"))
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
    tiles_per_step: int = 1,
    interpret: bool = False,
) -> jax.Array:
    """SwiGLU MLP `(silu(x @ w_gate) * (x @ w_up)) @ w_down` with the intermediate kept on-chip.

    Args:
      x: `[tokens, hidden]`.
      w_gate, w_up: `[hidden, intermediate]`; FP8 (`scales`): `[intermediate, hidden]`.
      w_down: `[intermediate, hidden]`; FP8: `[hidden, intermediate]`.
      norm_weight: `[hidden]`: apply RMSNorm (HF rounding) to x first, inside the kernel; None: no norm.
      scales: block-FP8 weights (float8_e4m3fn w_gate, w_up, w_down, [out, in] as checkpoints store them: each
        dot takes the weight's rows as M, `_mlp_kernel_fp8`): their float32 scales (gate, up, down), one per
        `scale_block` = (bk, bn) block of each [in, out] weight; the K tiles divide bk, block_i divides bk and bn.
        The normed x and the SwiGLU output meet them as e4m3 rows, quantized per K tile
        (pallas_kernels/dense/fp8_tiles.py). None: weights in x's dtype.
      eps: RMSNorm epsilon.
      block_t: tokens per tile (power of two >= 16); default min(64, next_pow2(tokens)).
      block_i: intermediate columns per program (power of two dividing intermediate, and bk, bn for FP8); default
        128 (`default_block_i`).
      num_warps, num_stages: Triton launch parameters; None picks (8, 3) for block_t 16 (FP8: (8, 4)), else (4, 2).
      unroll_norm: the norm's sum of squares as straight-line code (all of the row's loads in flight at once)
        rather than a loop of hidden / 128 dependent round trips (51.6 vs 55.2 us per Qwen3.5-4B layer at
        T = 1 on the H100, decode_mlp_variants_h100.json).
      tiles_per_step: (FP8) K tiles / down row blocks a loop step takes (2 measured fastest at Qwen3-8B's shapes;
        hidden must then be a multiple of 2 * bk and 2 * bn).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[tokens, hidden]` in x's dtype (fp32 accumulation).
    """
    scales = tuple(scales or ())
    if scales or scale_block is not None:
        if len(scales) != 3:
            raise ValueError(f"scales must be (gate, up, down) scales with scale_block, got {len(scales)}")
        scale_block = tuple(scale_block or ())
        w_gate, w_up, w_down = w_gate.T, w_up.T, w_down.T  # [in, out] views for the checks (not traced into the call)
    _check_args(x, w_gate, w_up, w_down, norm_weight, block_t, block_i)
    if scales:
        for name, w, s in zip(("w_gate", "w_up", "w_down"), (w_gate, w_up, w_down), scales, strict=True):
            check_scale(name, w, s, scale_block)
        if block_i is not None and (scale_block[0] % block_i or scale_block[1] % block_i):
            raise ValueError(f"block_i={block_i} must divide the FP8 scale blocks {scale_block}")
        if not fits_tiles_per_step(x.shape[1], scale_block, tiles_per_step):
            raise ValueError(f"tiles_per_step={tiles_per_step} K tiles / row blocks must divide hidden={x.shape[1]} "
                             f"(FP8 blocks {scale_block})")
        w_gate, w_up, w_down = w_gate.T, w_up.T, w_down.T
    else:
        for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
            check_scale(name, w, None, None)
        scale_block = None
    return _mlp_call(x, w_gate, w_up, w_down, norm_weight, scales, eps=eps, block_t=block_t, block_i=block_i,
                     num_warps=num_warps, num_stages=num_stages, unroll_norm=unroll_norm, scale_block=scale_block,
                     tiles_per_step=tiles_per_step, interpret=interpret)


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
