"""Grouped GEMMs of a mixture-of-experts MLP (Pallas, Triton lowering), over the expert-grouped layout
of `moe_routing.MoeRouting`.

- `moe_gate_up`: h[r] = silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e]) for each routed row r = (t, j) of
  the grouped layout, e its expert. One program owns (block of `block_m` rows, `block_n` columns):
  it reads the block's expert from the block table, gathers its tokens' rows of x by id (no permuted
  copy of x in HBM), streams the expert's gate and up columns over K and applies SwiGLU in registers
  before one store. Programs of unused blocks (expert -1) return at once, so a decode step reads only
  the experts it routes to.
- `moe_down`: y[p] = w[p] * (h[r] @ w_down[e]) for each pair p = t * k + j at row r, written back in
  token order (a masked scatter by pair id), so `y.reshape(T, k, H).sum(1)` is the MLP's output (the
  k-sum is left to XLA: deterministic, and it fuses with the residual add).

Grid: (blocks, column tiles), blocks fastest, so programs running side by side share the expert's
column tile (blocks of one expert are consecutive) and reuse it from L2 on large steps.

Tile sizes: `block_m` comes with the routing (the layout's padding unit: 16 for decode-sized steps,
where each expert has a few rows, 64-128 for prefill); `block_n` / `block_k` / warps / stages default
per step size (see `_launch`), overridable for sweeps.

Block-FP8 experts (`scales`, `scale_block`) come [E, out, in], as checkpoints store them (`Fp8Weight.transposed`,
fp8.kernel_layout): K-major e4m3 tiles, the dots' transposed right side, met by the gathered rows quantized to e4m3
per K tile (a scale per row), FP8 dots, each K tile's fp32 product times the rows' scales and its block scales
(pallas_kernels/dense/fp8_tiles.py, the dense kernels' helpers); the K tile divides the scale blocks' height, the
column tiles are bf16's (at decode a tile of 64 columns streams half the bytes with as many programs in flight).
Plain weights trace as without FP8.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`); the Mosaic GPU kernel
for large steps is `moe_gemm_mgpu.py`.
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
from pallas_kernels.moe.moe_routing import MoeRouting


# ----------------------------------------------------------------------------------------------
# Kernel bodies
# ----------------------------------------------------------------------------------------------
def _block(bexp_ref, brows_ref, sorted_ref, block_m):
    """This program's block: (expert, [bm] validity mask, [bm] pair ids (0 where invalid))."""
    b = pl.program_id(0)
    expert = bexp_ref[b]
    valid = jnp.arange(block_m, dtype=jnp.int32) < brows_ref[b]  # [bm]
    pairs = jnp.where(valid, sorted_ref[pl.ds(b * block_m, block_m)], 0)  # [bm]
    return expert, valid, pairs


def _gate_up_kernel(bexp_ref, brows_ref, sorted_ref, x_ref, wg_ref, wu_ref, *refs, top_k, block_m, block_n,
                    block_k, scale_block=None):
    # bexp_ref / brows_ref [NB] int32; sorted_ref [M] int32; x_ref [T, K]; wg_ref / wu_ref [E, K, N] ([E, N, K] FP8)
    # h_ref [M, N] (out): this program writes rows [b*bm, (b+1)*bm) x columns [n*bn, (n+1)*bn)
    # FP8 (scale_block (bk, bn)): sg_ref / su_ref [E, K / bk, N / bn] float32 (whole), before h_ref
    sg_ref, su_ref, h_ref = refs if scale_block is not None else (None, None, *refs)
    expert, valid, pairs = _block(bexp_ref, brows_ref, sorted_ref, block_m)
    tokens = pairs // top_k  # [bm]: padding rows read token 0, their h is never read
    b, n = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(n * block_n, block_n)

    @pl.when(expert >= 0)
    def _():
        def body(i, carry):
            g, u = carry  # [bm, bn] fp32 each
            ks = pl.ds(i * block_k, block_k)
            xk = x_ref[tokens, ks]  # [bm, bk]: the block's token rows, gathered
            if scale_block is None:
                g = g + plgpu.dot(xk, wg_ref[expert, ks, cols])
                u = u + plgpu.dot(xk, wu_ref[expert, ks, cols])
            else:  # e4m3 rows and their scales (once for gate and up) against e4m3 tiles and their block scales
                xk, xs = act_operand(xk)
                k0, n0 = i * block_k, n * block_n
                g = g + weight_dot(xk, wg_ref[expert, cols, ks], sg_ref, k0, n0, scale_block, xs, (expert,))
                u = u + weight_dot(xk, wu_ref[expert, cols, ks], su_ref, k0, n0, scale_block, xs, (expert,))
            return g, u

        zeros = jnp.zeros((block_m, block_n), jnp.float32)
        g, u = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, body, (zeros, zeros))
        h_ref[pl.ds(b * block_m, block_m), cols] = (g * jax.nn.sigmoid(g) * u).astype(h_ref.dtype)


def _down_kernel(bexp_ref, brows_ref, sorted_ref, w_ref, h_ref, wd_ref, *refs, block_m, block_n, block_k,
                 scale_block=None):
    # w_ref [T*k] fp32 routing weights by pair; h_ref [M, I]; wd_ref [E, I, N] ([E, N, I] FP8);
    # y_ref [T*k + 1, N] (out, by pair; the last row takes the masked-out lanes' addresses, never written)
    # FP8 (scale_block (bk, bn)): sd_ref [E, I / bk, N / bn] float32 (whole), before y_ref
    sd_ref, y_ref = refs if scale_block is not None else (None, *refs)
    expert, valid, pairs = _block(bexp_ref, brows_ref, sorted_ref, block_m)
    b, n = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(n * block_n, block_n)
    rows = pl.ds(b * block_m, block_m)

    @pl.when(expert >= 0)
    def _():
        def body(i, acc):
            ks = pl.ds(i * block_k, block_k)
            if scale_block is None:
                return acc + plgpu.dot(h_ref[rows, ks], wd_ref[expert, ks, cols])
            hk, hs = act_operand(h_ref[rows, ks])
            return acc + weight_dot(hk, wd_ref[expert, cols, ks], sd_ref, i * block_k, n * block_n, scale_block, hs,
                                    (expert,))

        acc = jax.lax.fori_loop(0, h_ref.shape[1] // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
        acc = acc * w_ref[pairs][:, None]  # [bm, bn] weighted by each pair's routing weight
        # Scatter by pair id, both axes as index arrays (the interpreter has no masked store that mixes
        # index arrays and slices); masked-out lanes aim at the spare last row.
        dest = jnp.where(valid, pairs, y_ref.shape[0] - 1)[:, None]  # [bm, 1]
        col_ids = (n * block_n + jnp.arange(block_n, dtype=jnp.int32))[None, :]  # [1, bn]
        plgpu.store(y_ref.at[dest, col_ids], acc.astype(y_ref.dtype), mask=valid[:, None])


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------
def default_block_k(block_m: int, k: int, scale_block: tuple[int, int] | None = None) -> int:
    """The K tile for blocks of `block_m` rows (FP8: inside one scale block; the rows' quantization group)."""
    return tile_k(k, 128 if block_m <= 32 else 64, scale_block)


def _launch(block_m, k, n, block_n, block_k, num_warps, num_stages, scale_block=None):
    """Defaults: decode-sized blocks (16 rows) are weight streams: narrow column tiles for more programs in
    flight, deep pipelines; prefill-sized ones are tensor-core tiles. FP8 (`scale_block`): the same tiles, the K
    tile inside one scale block (the column tile may span several: a scale per column)."""
    small = block_m <= 32
    block_n = block_n or pow2_divisor(n, 64 if small else 128)
    block_k = block_k or default_block_k(block_m, k, scale_block)
    num_warps = num_warps or (4 if small else 8)
    num_stages = num_stages or (4 if small else 3)
    if scale_block is not None and scale_block[0] % block_k:
        raise ValueError(f"block_k={block_k} must divide the FP8 scale blocks' height {scale_block[0]}")
    return block_n, block_k, num_warps, num_stages


def _fp8_kwargs(scales, scale_block) -> tuple[dict, str]:
    """The kernels' FP8 keywords and name suffix (none for plain weights: their trace is the one without FP8)."""
    return ({"scale_block": scale_block}, "_fp8") if scales else ({}, "")


def _gate_up_call(x, routing, w_gate, w_up, scales, *, scale_block, block_n, block_k, num_warps, num_stages,
                  interpret):
    _, k = x.shape
    n = w_gate.shape[1 if scales else 2]
    bm = routing.block_m
    block_n, block_k, num_warps, num_stages = _launch(bm, k, n, block_n, block_k, num_warps, num_stages, scale_block)
    m, nb = routing.sorted_pairs.shape[0], routing.block_expert.shape[0]
    fp8, suffix = _fp8_kwargs(scales, scale_block)
    kernel = functools.partial(_gate_up_kernel, top_k=routing.top_k, block_m=bm, block_n=block_n, block_k=block_k,
                               **fp8)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(nb, n // block_n),
        in_specs=[whole] * (6 + len(scales)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"moe_gate_up_m{bm}_n{block_n}_k{block_k}{suffix}",
    )(routing.block_expert, routing.block_rows, routing.sorted_pairs, x, w_gate, w_up, *scales)


def _down_call(h, routing, w_down, scales, *, scale_block, block_n, block_k, num_warps, num_stages, interpret):
    _, k = h.shape
    n = w_down.shape[1 if scales else 2]
    bm = routing.block_m
    block_n, block_k, num_warps, num_stages = _launch(bm, k, n, block_n, block_k, num_warps, num_stages, scale_block)
    pairs = routing.topk_ids.size
    fp8, suffix = _fp8_kwargs(scales, scale_block)
    kernel = functools.partial(_down_kernel, block_m=bm, block_n=block_n, block_k=block_k, **fp8)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(routing.block_expert.shape[0], n // block_n),
        in_specs=[whole] * (6 + len(scales)),
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((pairs + 1, n), h.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"moe_down_m{bm}_n{block_n}_k{block_k}{suffix}",
    )(routing.block_expert, routing.block_rows, routing.sorted_pairs, routing.topk_weights.reshape(-1), h,
      w_down, *scales)[:pairs]  # (the slice fuses into the consumer's k-sum)


def _check_routing(routing: MoeRouting):
    bm = routing.block_m
    if bm < 16 or bm & (bm - 1):
        raise ValueError(f"routing.block_m={bm} must be a power of two >= 16 (tensor-core tiles)")
    if routing.sorted_pairs.shape[0] != bm * routing.block_expert.shape[0]:
        raise ValueError(f"routing.sorted_pairs {routing.sorted_pairs.shape} must hold block_m x blocks rows")


def _check_fp8(names, weights, scales, scale_block) -> tuple:
    """The scales as a tuple (empty for plain weights), checked against their weights (fp8_tiles.check_scale; FP8
    weights [E, N, K] against the [E, K, N] blocks' scales)."""
    scales = (None,) * len(weights) if scales is None else tuple(scales)
    if len(scales) != len(weights):
        raise ValueError(f"scales must be one per weight ({', '.join(names)}), got {len(scales)}")
    for name, w, scale in zip(names, weights, scales, strict=True):
        check_scale(name, w if scale is None else jnp.swapaxes(w, -1, -2), scale, scale_block)
    return () if scales[0] is None else scales


_TUNING = ("scale_block", "block_n", "block_k", "num_warps", "num_stages", "interpret")


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=_TUNING)
def moe_gate_up(x: jax.Array, routing: MoeRouting, w_gate: jax.Array, w_up: jax.Array,
                scales: tuple[jax.Array, jax.Array] | None = None, *, scale_block: tuple[int, int] | None = None,
                block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """silu(x @ w_gate[e]) * (x @ w_up[e]) for every routed row of the grouped layout.

    Args:
      x: `[tokens, hidden]` (the normed MLP input).
      routing: `moe_route(...)` of these tokens.
      w_gate, w_up: `[experts, hidden, intermediate]` in x's dtype, or float8_e4m3fn
        `[experts, intermediate, hidden]` (the checkpoint's [out, in], `Fp8Weight.transposed`) with `scales`.
      scales: block-FP8 weights' float32 scales (gate's, up's), `[experts, hidden / bk, intermediate / bn]` for
        `scale_block` = (bk, bn) (the K tile then divides bk); x's rows then meet them as e4m3 quantized per K
        tile (pallas_kernels/dense/fp8_tiles.py).
      block_n, block_k, num_warps, num_stages: tile and launch overrides (powers of two dividing the dims).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[rows, intermediate]` in x's dtype, rows in the grouped layout (fp32 accumulation); rows past a
      block's valid rows and rows of unused blocks are unspecified.
    """
    fp8 = scales is not None
    if x.ndim != 2 or w_gate.ndim != 3 or w_gate.shape[2 if fp8 else 1] != x.shape[1] or w_up.shape != w_gate.shape:
        raise ValueError(f"x must be [tokens, hidden] and w_gate/w_up [experts, hidden, intermediate] "
                         f"(block-FP8: [experts, intermediate, hidden]): {x.shape=} {w_gate.shape=} {w_up.shape=}")
    if routing.topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"routing is for {routing.topk_ids.shape[0]} tokens, x has {x.shape[0]}")
    _check_routing(routing)
    if x.shape[1] % 16 or w_gate.shape[1] % 16 or w_gate.shape[2] % 16:
        raise ValueError(f"hidden and intermediate must be multiples of 16: {w_gate.shape=}")
    scales = _check_fp8(("w_gate", "w_up"), (w_gate, w_up), scales, scale_block)
    return _gate_up_call(x, routing, w_gate, w_up, scales, scale_block=scale_block, block_n=block_n, block_k=block_k,
                         num_warps=num_warps, num_stages=num_stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=_TUNING)
def moe_down(h: jax.Array, routing: MoeRouting, w_down: jax.Array, scale: jax.Array | None = None, *,
             scale_block: tuple[int, int] | None = None, block_n: int | None = None, block_k: int | None = None,
             num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """routing weight x (h[row] @ w_down[e]) for every (token, slot) pair, in token order.

    Args:
      h: `[rows, intermediate]`, `moe_gate_up`'s output.
      routing: the same routing.
      w_down: `[experts, intermediate, hidden]` in h's dtype, or float8_e4m3fn `[experts, hidden, intermediate]`
        with `scale` `[experts, intermediate / bk, hidden / bn]` for `scale_block` = (bk, bn) (as `moe_gate_up`'s).

    Returns:
      `[tokens * top_k, hidden]` in h's dtype: row t * k + j is slot j of token t; the MLP output is
      `.reshape(tokens, top_k, hidden).sum(1)`.
    """
    if h.ndim != 2 or w_down.ndim != 3 or w_down.shape[1 if scale is None else 2] != h.shape[1]:
        raise ValueError(f"h must be [rows, intermediate] and w_down [experts, intermediate, hidden] "
                         f"(block-FP8: [experts, hidden, intermediate]): {h.shape=} {w_down.shape=}")
    if h.shape[0] != routing.sorted_pairs.shape[0]:
        raise ValueError(f"h has {h.shape[0]} rows, the routing's layout {routing.sorted_pairs.shape[0]}")
    _check_routing(routing)
    if w_down.shape[1] % 16 or w_down.shape[2] % 16:
        raise ValueError(f"intermediate and hidden must be multiples of 16: {w_down.shape=}")
    scales = _check_fp8(("w_down",), (w_down,), None if scale is None else (scale,), scale_block)
    return _down_call(h, routing, w_down, scales, scale_block=scale_block, block_n=block_n, block_k=block_k,
                      num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def moe_combine(y: jax.Array, top_k: int, dtype, mine: jax.Array | None = None) -> jax.Array:
    """[T*k, H] weighted expert outputs by pair -> [T, H]: the sum over each token's k slots (fp32).
    `mine` [T, k]: only these pairs (expert parallelism: the rows of pairs routed to other devices are
    never written)."""
    y = y.reshape(-1, top_k, y.shape[-1]).astype(jnp.float32)
    if mine is not None:
        y = jnp.where(mine[:, :, None], y, 0.0)
    return y.sum(axis=1).astype(dtype)


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------
def _row_experts(routing: MoeRouting) -> jax.Array:
    return jnp.repeat(jnp.maximum(routing.block_expert, 0), routing.block_m)  # [M]


_REFERENCE_STATIC = ("scale_block", "block_k")


def _reference_operands(x, weights, scales, scale_block, block_k, block_m):
    """The references' FP8 inputs: the [E, N, K] weights dequantized to float32 [E, K, N] (fp8_tiles.dequantize), x's
    rows FP8-quantized per K tile as the kernels do (`fake_quant_rows`; block_k: the kernel's, default
    `default_block_k`)."""
    if scales is None:
        return x, weights
    x = fake_quant_rows(x, block_k or default_block_k(block_m, x.shape[1], scale_block))
    return x, tuple(dequantize(jnp.swapaxes(w, -1, -2), s, scale_block) for w, s in zip(weights, scales, strict=True))


@functools.partial(jax.jit, static_argnames=_REFERENCE_STATIC)
def moe_gate_up_reference(x, routing: MoeRouting, w_gate, w_up, scales=None, *, scale_block=None, block_k=None):
    """Per-row jnp: each row of the layout times its expert's weights (fp32 accumulation); block-FP8 weights met by
    FP8-quantized rows (`_reference_operands`)."""
    e = _row_experts(routing)
    xs, (w_gate, w_up) = _reference_operands(x[routing.sorted_pairs // routing.top_k], (w_gate, w_up), scales,
                                             scale_block, block_k, routing.block_m)  # xs [M, K]
    g = jnp.einsum("mk,mkn->mn", xs, w_gate[e], preferred_element_type=jnp.float32)
    u = jnp.einsum("mk,mkn->mn", xs, w_up[e], preferred_element_type=jnp.float32)
    return (jax.nn.silu(g) * u).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=_REFERENCE_STATIC)
def moe_down_reference(h, routing: MoeRouting, w_down, scale=None, *, scale_block=None, block_k=None):
    e = _row_experts(routing)[routing.pair_rows.reshape(-1)]  # [T*k]
    hp, (w_down,) = _reference_operands(h[routing.pair_rows.reshape(-1)], (w_down,),  # hp [T*k, I]
                                        None if scale is None else (scale,), scale_block, block_k, routing.block_m)
    y = jnp.einsum("pi,pih->ph", hp, w_down[e], preferred_element_type=jnp.float32)
    return (y * routing.topk_weights.reshape(-1, 1)).astype(h.dtype)
