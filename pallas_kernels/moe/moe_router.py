"""The MoE block's front end for decode-sized steps as one kernel: `moe_norm_route`, the RMSNorm, the router
projection and the routing (moe_routing.route_body) in one launch (used by the engine for steps of <= 8 tokens,
KernelPolicy.moe_front_max_tokens):

    h = rms_norm(x) * norm_weight                 (HF rounding: normalised in fp32, cast, times the weight)
    logits = round_to_x_dtype(h @ router)         (fp32 accumulation; HF's F.linear output dtype; DeepSeek's fp32
                                                   router keeps them fp32: `round_logits=False`)
    routing = moe_route(logits)                   (softmax in fp32, top-k, the expert-grouped layout)

Shared experts stacked after the routed ones ride along (`shared`: moe_routing.route_body gives them the last slots
of every token), weighted 1 or, with `shared_gate`, sigmoid(h @ gate) per token (Qwen3.5-MoE's
`shared_expert_gate`), the gate a 17th column block of the router: [hidden, E + GATE_COLUMNS], its column E the gate
and the rest zeros (`gated_router`); the routed weights can carry a scaling factor (DeepSeek's).

At batch 1 XLA runs the first two as ~7 kernels per layer (the norm's reduction and multiply, the batch-1 dot's
padding row, the dot, the logits' conversions) and the routing as an 8th: ~14 us a Qwen3-30B-A3B layer on the
H100, against 7.3 us for this kernel (`local_step_front_profile_qwen3-30b-a3b_h100.json`). An earlier kernel that
did the norm and the router only (one program per 16 experts over the whole K range, then the routing kernel)
measured no faster than XLA and was removed (`moe_front_sweep_h100_5cfb2c2.txt`): at batch 1 its 8 programs each
streamed 64 KB in a chain of dependent loads; here the K range is split too, 32 programs.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, pow2_divisor, rms_inverse, rms_normed, tile_rows
from pallas_kernels.moe.moe_routing import (
    MoeRouting,
    check_route_args,
    route_body,
    route_out_shapes,
    routing_from_outputs,
)
from pallas_kernels.split_k import check_counters, sum_splits, take_ticket

# Largest step the kernel takes (rows held in registers; larger steps keep XLA's fusions and GEMM).
MAX_TOKENS = 64
# A gated shared expert's router block: its gate column, then zeros (a block of the kernel's expert tiles).
GATE_COLUMNS = 16


def gated_router(router: jax.Array, gate: jax.Array) -> jax.Array:
    """The router [hidden, E] with a shared expert's gate [hidden, 1] as column E, padded to E + GATE_COLUMNS."""
    pad = jnp.zeros((router.shape[0], GATE_COLUMNS - 1), router.dtype)
    return jnp.concatenate([router, gate.astype(router.dtype), pad], axis=1)


def _check_blocks(block_e: int, experts: int, block_k: int, hidden: int) -> None:
    for name, b, n in (("block_e", block_e, experts), ("block_k", block_k, hidden)):
        if b & (b - 1) or n % b or b < (8 if name == "block_e" else 16):
            raise ValueError(f"{name}={b} must be a power of two dividing {n} (>= {8 if name == 'block_e' else 16})")


# ----------------------------------------------------------------------------------------------
# The whole front end: norm, router, routing
# ----------------------------------------------------------------------------------------------
def _front_kernel(x_ref, n_ref, w_ref, _cnt_in, h_ref, ids_ref, wts_ref, rows_ref, sorted_ref, bexp_ref, brows_ref,
                  cnt_ref, part_ref, *, experts, block_t, block_k, k_splits, top_k, block_m, renormalize, round_logits,
                  eps, scaling, shared, shared_gate, interpret):
    # x_ref [T, H] (whole); n_ref [H]; w_ref [H, block_e]: this program's router columns, of which it reads K split
    # `split`; h_ref [T, H] (whole, written by the programs of expert block 0, each its K split); the routing
    # outputs as moe_routing.route_body's; cnt_ref [>= 1] int32 (counter 0: zero on entry, left zero);
    # part_ref [S, T, C] fp32: each program's partial logits (C: the router's columns, `experts` of them routed, then
    # a gated shared expert's block), summed by the program that arrives last.
    tokens, hidden = x_ref.shape
    block_e = w_ref.shape[1]
    eb, split = pl.program_id(0), pl.program_id(1)
    rows, real, x_cols = tile_rows(x_ref, 0, block_t)
    inv = rms_inverse(x_cols, hidden, block_t, block_k, eps)  # [block_t]
    steps = hidden // k_splits // block_k
    # float32 weights (the goldens): exact products, not TF32 (bf16 inputs are exact either way)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(kk, acc):
        cols = pl.ds((split * steps + kk) * block_k, block_k)
        hk = rms_normed(x_cols(cols, block_k), inv, n_ref[cols])

        @pl.when(eb == 0)
        def _():
            plgpu.store(h_ref.at[rows, cols], hk, mask=jnp.broadcast_to(real[:, None], (block_t, block_k)))

        return acc + plgpu.dot(hk, w_ref[cols, :], precision=precision)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((block_t, block_e), jnp.float32))
    plgpu.store(part_ref.at[split, rows, pl.ds(eb * block_e, block_e)], acc,
                mask=jnp.broadcast_to(real[:, None], (block_t, block_e)))
    ticket = take_ticket(cnt_ref, jnp.int32(0), interpret)

    @pl.when(ticket == pl.num_programs(0) * k_splits - 1)
    def _last():  # the splits summed in split order (deterministic), read past L1 (volatile), then routed
        tp, ep = ids_ref.shape[0], next_pow2(experts)
        t = jax.lax.broadcasted_iota(jnp.int32, (tp, ep), 0)
        e = jax.lax.broadcasted_iota(jnp.int32, (tp, ep), 1)
        ok = (t < tokens) & (e < experts)
        logits = sum_splits(part_ref, k_splits, lambda s_: (s_, pl.ds(0, tp), pl.ds(0, ep)), ok)
        if round_logits:
            logits = logits.astype(x_ref.dtype).astype(jnp.float32)  # F.linear's output dtype, as the XLA path
        logits = jnp.where(e < experts, logits, jnp.where(t < tokens, -jnp.inf, 0.0))  # padding rows finite
        gate = None
        if shared_gate:  # the gate's column block: its first column, rounded and activated as the XLA path does
            g = sum_splits(part_ref, k_splits, lambda s_: (s_, pl.ds(0, tp), pl.ds(experts, GATE_COLUMNS)),
                           jax.lax.broadcasted_iota(jnp.int32, (tp, GATE_COLUMNS), 0) < tokens)
            first = jax.lax.broadcasted_iota(jnp.int32, (tp, GATE_COLUMNS), 1) == 0
            g = jnp.sum(jnp.where(first, g, 0.0), axis=1, keepdims=True)  # [Tp, 1]
            if round_logits:
                g = g.astype(x_ref.dtype).astype(jnp.float32)
            gate = jax.nn.sigmoid(g)
            if round_logits:
                gate = gate.astype(x_ref.dtype).astype(jnp.float32)
        cnt_ref[0] = 0  # left zero for the next call that shares the buffer
        route_body(logits, ids_ref, wts_ref, rows_ref, sorted_ref, bexp_ref, brows_ref, tokens=tokens,
                   experts=experts, top_k=top_k, block_m=block_m, renormalize=renormalize, scaling=scaling,
                   shared=shared, shared_weight=gate)


def front_supported(tokens: int, hidden: int, experts: int) -> str | None:
    """Why `moe_norm_route` cannot take these shapes, or None."""
    if not 1 <= tokens <= MAX_TOKENS:
        return f"{tokens} tokens not in [1, {MAX_TOKENS}]"
    if hidden % 16 or experts % 8:
        return f"hidden {hidden} must be a multiple of 16 and experts {experts} of 8"
    return None


def default_front_tiling(tokens: int, hidden: int, experts: int) -> tuple[int, int, int]:
    """(block_e, block_k, k_splits): 16 experts a program (the smallest tensor-core tile) and the K range split
    while the step is small, so ~32 programs stream the router (at one token 8 expert blocks alone would each
    read 64 KB in a chain of loads); at 16+ tokens the last program's partials would outweigh that."""
    block_e = pow2_divisor(experts, 16)
    block_k = pow2_divisor(hidden, 256)
    k_splits = 1
    while tokens <= 8 and (experts // block_e) * k_splits * 2 <= 32 and hidden % (2 * k_splits * block_k) == 0:
        k_splits *= 2
    return block_e, block_k, k_splits


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "block_m", "eps", "round_logits", "scaling",
                                             "shared", "shared_gate", "block_e", "block_k", "k_splits", "num_warps",
                                             "num_stages", "interpret"))
def moe_norm_route(x: jax.Array, norm_weight: jax.Array, router: jax.Array, counters: jax.Array, *, top_k: int,
                   renormalize: bool, block_m: int, eps: float, round_logits: bool = True, scaling: float = 1.0,
                   shared: int = 0, shared_gate: bool = False, block_e: int | None = None,
                   block_k: int | None = None, k_splits: int | None = None, num_warps: int | None = None,
                   num_stages: int = 3, interpret: bool = False) -> tuple[jax.Array, MoeRouting, jax.Array]:
    """A decode step's MoE front end in one kernel: (h, routing, counters) where `h = rms_norm(x) * norm_weight`,
    the router logits `h @ router` are rounded to x's dtype (HF's F.linear; kept fp32 without `round_logits`, as
    DeepSeek-V2's router computes them) and routed as `moe_routing.moe_route` does (softmax in fp32, top-k,
    renormalised when `renormalize`, grouped by expert in blocks of `block_m`).

    One program per (16 experts, K split) computes its partial logits; the program that arrives last at
    `counters[0]` sums them in split order and routes (moe_routing.route_body). So the norm, the router's dot and
    the routing are one launch where XLA makes ~7 kernels and the routing program an 8th.

    Args:
      x: `[tokens, hidden]`, tokens <= MAX_TOKENS; norm_weight `[hidden]`; router `[hidden, experts]` (with
        `shared_gate`: `[hidden, experts + GATE_COLUMNS]`, `gated_router`).
      counters: int32 `[>= 1]`, counter 0 zero on entry (`ModelOps.step_counters`); returned zero again (aliased).
      scaling: the routed weights' factor (after any renormalisation).
      shared: shared experts stacked after the routed ones (ids experts..experts + shared - 1): every token's last
        `shared` slots, weighted 1, or with `shared_gate` sigmoid(h @ the router's column `experts`) (rounded to x's
        dtype, before and after the sigmoid, with `round_logits`, as the XLA path's bf16 dot and sigmoid).
      block_e, block_k, k_splits: tiling (default `default_front_tiling`); num_warps (default 4), num_stages.
      interpret: run the Pallas interpreter (CPU tests).
    """
    if x.ndim != 2 or norm_weight.shape != (x.shape[1],) or router.ndim != 2 or router.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [tokens, hidden], norm_weight [hidden], router [hidden, experts]: {x.shape=} "
                         f"{norm_weight.shape=} {router.shape=}")
    tokens, hidden = x.shape
    columns = router.shape[1]
    experts = columns - GATE_COLUMNS if shared_gate else columns
    if shared_gate and not shared:
        raise ValueError("shared_gate needs shared experts")
    if norm_weight.dtype != x.dtype or router.dtype != x.dtype:
        raise ValueError(f"x, norm_weight and router must share a dtype: {x.dtype}, {norm_weight.dtype}, "
                         f"{router.dtype}")
    why = front_supported(tokens, hidden, experts)
    if why is not None:
        raise ValueError(why)
    check_route_args(experts, top_k, block_m)
    if block_m < 16:  # the grouped GEMMs' smallest tile
        raise ValueError(f"block_m={block_m} must be >= 16")
    check_counters(counters, 1)
    d_e, d_k, d_s = default_front_tiling(tokens, hidden, experts)
    block_e, block_k, k_splits = block_e or d_e, block_k or d_k, k_splits or d_s
    _check_blocks(block_e, experts, block_k, hidden)
    if shared_gate and GATE_COLUMNS % block_e:
        raise ValueError(f"block_e={block_e} must divide the gate's {GATE_COLUMNS} columns")
    if hidden % (block_k * k_splits):
        raise ValueError(f"block_k {block_k} x k_splits {k_splits} must divide hidden {hidden}")
    block_t = max(16, next_pow2(tokens))
    kernel = functools.partial(_front_kernel, experts=experts, block_t=block_t, block_k=block_k, k_splits=k_splits,
                               top_k=top_k, block_m=block_m, renormalize=renormalize, round_logits=round_logits,
                               eps=eps, scaling=scaling, shared=shared, shared_gate=shared_gate, interpret=interpret)
    whole = pl.no_block_spec
    h, *routed, counters, _ = pl.pallas_call(
        kernel,
        grid=(columns // block_e, k_splits),
        in_specs=[whole, pl.BlockSpec((hidden,), lambda e, s: (0,)),
                  pl.BlockSpec((hidden, block_e), lambda e, s: (0, e)), whole],
        out_specs=[whole] * 9,
        out_shape=[jax.ShapeDtypeStruct((tokens, hidden), x.dtype),
                   *route_out_shapes(tokens, experts, top_k, block_m, shared),
                   jax.ShapeDtypeStruct(counters.shape, jnp.int32),
                   jax.ShapeDtypeStruct((k_splits, tokens, columns), jnp.float32)],
        input_output_aliases={3: 7},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or 4, num_stages=num_stages),
        interpret=interpret,
        name=f"moe_norm_route_t{block_t}_e{block_e}_k{block_k}_s{k_splits}" + (f"_sh{shared}" if shared else ""),
    )(x, norm_weight, router, counters)
    return h, routing_from_outputs(tokens, top_k + shared, *routed), counters


def moe_norm_router_reference(x: jax.Array, norm_weight: jax.Array, router: jax.Array, *, eps: float,
                              round_logits: bool = True) -> tuple[jax.Array, jax.Array]:
    """(h, logits) as `ops.moe_block` computes them with XLA: HF's RMSNorm, then the router's F.linear in x's dtype
    (returned as fp32 holding values of x's dtype, what `moe_route` takes; fp32 ones without `round_logits`)."""
    xf = x.astype(jnp.float32)
    h = norm_weight * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    # float32: exact products as the kernel takes them (XLA's default on a GPU is TF32, ~1e-3 relative)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    logits = jnp.dot(h, router, precision=precision, preferred_element_type=jnp.float32)
    return h, logits.astype(x.dtype).astype(jnp.float32) if round_logits else logits
