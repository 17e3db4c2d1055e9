"""The mixture-of-experts blocks' kernel choice (`MoeOps.moe_block`; DeepSeekMoE's `grouped_moe_block`).

The norm, router matmul and routing run as one kernel in small steps (pallas_kernels/moe/moe_router.py:
`moe_norm_route`, up to `KernelPolicy.moe_front_max_tokens`), else the router matmul in XLA and the routing kernel;
then the two grouped GEMMs of pallas_kernels/moe/moe_routing.py and moe_gemm.py over the expert-grouped layout,
with `moe_block_m` rows per block. Steps routing at least `mosaic_moe_min_rows_per_expert` rows per expert run the
experts on the Mosaic GPU grouped GEMM instead (moe_gemm_mgpu.py: 482 TFLOP/s at 4096 tokens x top-8 on the H100,
against 251 for the Triton kernels; at 512 and 1024 tokens it was weight-bound at 84-167 TFLOP/s and the Triton
kernels were not measured there, so they keep those steps; moe_kernels_h100.json, moe_mgpu_h100.json). The
reference is `layers.moe_mlp` (`lax.ragged_dot`). DeepSeek chooses its experts in XLA (`layers.grouped_topk_routing`:
group-limited top-k, V3's sigmoid and correction bias), then `moe_route_chosen` lays them out and the same expert
kernels run; its softmax routing without groups or bias (V2-Lite) takes the one-kernel front end in small steps, with
float32 logits (DeepSeek-V2-Lite batch-1 TPOT, medians of 3 host-bound processes: 2.81 vs 3.31 ms, runs 2.70-3.43 vs
2.98-3.92; ab_front_kernel_deepseek-v2-lite_h200.json).

Block-FP8 experts (`Fp8Weight`, values [E, out, in]: fp8.kernel_layout) run on the Triton GEMMs: they read the e4m3
tiles (K-major, as FP8 tensor cores take a GEMM's right side) and their scales and meet them with the rows quantized
to e4m3 per K tile (a scale per row, FP8 dots). Steps past `mosaic_moe_min_rows_per_expert` rows per expert take the
grouped Mosaic GPU e4m3 GEMM instead (moe_fp8_mgpu.py; 128 x 128 blocks). Unmeasured: bench_moe.py --fp8 times them.
Experts the kernels cannot read (FP8 mixed with plain) take `layers.moe_mlp`, which dequantizes (`refuse_fp8`).

Shared experts stacked after the routed ones at load (`jinfer/models/shared_experts.py`: bf16 / float32 weights, not
under expert parallel; `stacked` S of them) run in the same grouped-GEMM launches: every token routes to them in its
last S slots, weighted 1 or by its gate (Qwen3.5-MoE's sigmoid(h @ gate), the router's gate column block), laid out
by the routing kernels themselves (`moe_routing.layout_body`). Otherwise they go through `DenseOps.swiglu` (the fused
MLP kernel in small steps, FP8's e4m3 GEMM in large ones).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jinfer.models.fp8 import dense
from jinfer.models.layers import grouped_topk_routing, moe_mlp, rms_norm
from jinfer.ops.dense import fp8_operands

MOSAIC_MOE_BLOCK_M = 128  # the Mosaic GPU grouped GEMM's rows per block


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block of the expert-grouped layout (the grouped GEMMs' M tile): 16 (the smallest
    tensor-core tile) while experts get a few rows each (decode), larger tiles as they fill."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 64


class MoeOps:
    """ModelOps' mixture-of-experts block (mixed into `jinfer.ops.ModelOps`, whose fields it reads)."""

    def moe_block(self, x: jax.Array, norm: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                  w_down: jax.Array, *, top_k: int, renormalize: bool, eps: float, counters: jax.Array | None = None,
                  shared: tuple[jax.Array, ...] | None = None, num_real: jax.Array | None = None,
                  stacked: int = 0) -> tuple:
        """(x + moe(rms_norm(x)), counters); x: [T, hidden]; router: [hidden, E]; experts stacked [E, ...].
        counters: the step's (`step_counters`), passed on; with them a small step's norm, router and routing are
        one kernel (`moe_norm_route`). `shared` (Qwen3.5-MoE): a shared expert's (gate, up, down, sigmoid gate
        [hidden, 1]) added to the routed experts' output (`shared_expert`); or `stacked` shared experts after the
        routed ones in the expert weights (`_stacked_moe_block`). `num_real` (the expert-load recorder: the step's
        real tokens, its first rows): also return the layer's `expert_counts` [E], a third output.

        Sharded (`axis`), the experts here are this device's: their intermediate columns (tensor
        parallel) or, when there are fewer of them than the router's E, experts [e0, e0 + E_local)
        (expert parallel). Every device routes every token; the psum adds the partial outputs.
        """
        if stacked:
            return self._stacked_moe_block(x, norm, router, (w_gate, w_up, w_down), stacked, counters, num_real,
                                           top_k=top_k, renormalize=renormalize, eps=eps)
        num_experts, hidden, inter = w_gate.shape
        policy = self.policy
        first = None  # expert parallel: the id of this device's first expert
        if num_experts != router.shape[1]:
            first = jax.lax.axis_index(self.axis) * num_experts
        kernels = self._moe_kernels(hidden, inter, w_gate, w_up, w_down)  # their operands, or None
        routing = None
        if front := self._norm_route(x, norm, router, counters, kernels, top_k=top_k, renormalize=renormalize,
                                     eps=eps):
            h, routing, counters = front
        else:
            h = rms_norm(x, norm, eps)
            # router logits rounded to the activation dtype, as HF's F.linear (and vLLM) produce them
            logits = self.project(h, router, preferred_element_type=jnp.float32).astype(h.dtype)  # [T, E]
        extra = 0 if shared is None else self.shared_expert(h, *shared)
        if not kernels:
            out = moe_mlp(h, logits, w_gate, w_up, w_down, top_k, renormalize, first, return_ids=num_real is not None)
            out, ids = out if num_real is not None else (out, None)
        else:
            from pallas_kernels.moe.moe_routing import moe_route

            def route(block_m):
                return moe_route(logits, top_k=top_k, renormalize=renormalize, block_m=block_m,
                                 interpret=self.interpret, **policy.launch_args("moe_route"))

            out, routing = self._routed_experts(h, route, kernels, first, top_k, router.shape[1], routing)
            ids = routing.topk_ids
        x = x + self.reduce(out + extra)
        if num_real is None:
            return x, counters
        return x, counters, expert_counts(ids, num_real, router.shape[1])

    def grouped_moe_block(self, x: jax.Array, norm: jax.Array, router: jax.Array, bias: jax.Array | None,
                          w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, shared: tuple[jax.Array, ...] | None,
                          *, top_k: int, n_group: int, topk_group: int, sigmoid: bool, renormalize: bool,
                          scaling: float, eps: float, counters: jax.Array | None = None,
                          num_real: jax.Array | None = None, stacked: int = 0) -> tuple:
        """DeepSeekMoE: (x + routed experts + shared experts (`shared`: their (gate, up, down), or None) of
        rms_norm(x), counters), routed by `layers.grouped_topk_routing` on float32 router logits, as HF computes them
        (in XLA); its weights carry the routed scaling factor, as HF's router applies it. The routed experts run as
        `moe_block`'s do (`moe_routing.moe_route_chosen` lays the chosen pairs out for the grouped GEMMs), the shared
        ones on `shared_expert`. Softmax routing without groups or bias (DeepSeek-V2-Lite) is `moe_block`'s, so a
        small step given the step's `counters` takes its one-kernel front end (`moe_norm_route`, float32 logits).
        Sharded as `moe_block` (tensor or expert parallel, one psum). `num_real`: as `moe_block`'s (then also returns
        the layer's `expert_counts`). `stacked`: the shared experts are in the expert weights instead (`shared` None;
        `_stacked_moe_block`)."""
        softmax = not sigmoid and bias is None and n_group <= 1  # (moe_block's routing)
        if stacked:
            choose = None if softmax else functools.partial(
                grouped_topk_routing, bias=bias, top_k=top_k, n_group=n_group, topk_group=topk_group, sigmoid=sigmoid,
                renormalize=renormalize, scaling=scaling)
            return self._stacked_moe_block(x, norm, router, (w_gate, w_up, w_down), stacked, counters, num_real,
                                           top_k=top_k, renormalize=renormalize, eps=eps, scaling=scaling,
                                           round_logits=False, choose=choose)
        num_experts, hidden, inter = w_gate.shape
        experts = router.shape[1]
        first = None
        if num_experts != experts:  # expert parallel: this device's experts
            first = jax.lax.axis_index(self.axis) * num_experts
        kernels = self._moe_kernels(hidden, inter, w_gate, w_up, w_down)
        if softmax and (front := self._norm_route(x, norm, router, counters, kernels, top_k=top_k,
                                                  renormalize=renormalize, eps=eps, round_logits=False)):
            h, routing, counters = front
            if scaling != 1.0:
                routing = dataclasses.replace(routing, topk_weights=routing.topk_weights * scaling)
            y, _ = self._routed_experts(h, None, kernels, first, top_k, experts, routing)
            ids = routing.topk_ids
        else:
            h = rms_norm(x, norm, eps)
            logits = self.project(h, router, preferred_element_type=jnp.float32)  # [T, E]
            weights, ids = grouped_topk_routing(logits, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                                sigmoid=sigmoid, renormalize=renormalize, scaling=scaling)
            if kernels:
                from pallas_kernels.moe.moe_routing import moe_route_chosen

                def route(block_m):
                    return moe_route_chosen(ids, weights, num_experts=experts, block_m=block_m,
                                            interpret=self.interpret)

                y, _ = self._routed_experts(h, route, kernels, first, top_k, experts)
            else:
                y = moe_mlp(h, logits, w_gate, w_up, w_down, top_k, renormalize, first, routed=(weights, ids))
        if shared is not None:
            y = y + self.shared_expert(h, *shared)
        x = x + self.reduce(y)
        return (x, counters) if num_real is None else (x, counters, expert_counts(ids, num_real, experts))

    def _stacked_moe_block(self, x, norm, router, weights, stacked: int, counters, num_real, *, top_k: int,
                           renormalize: bool, eps: float, scaling: float = 1.0, round_logits: bool = True,
                           choose=None) -> tuple:
        """(x + the routed experts' and `stacked` shared experts' outputs of rms_norm(x), counters[, expert counts]):
        the shared experts are the last `stacked` of the weights [E + S, ...] (jinfer/models/shared_experts.py), every
        token's last slots, weighted 1, or, where the router has a gate column block ([hidden, E + GATE_COLUMNS]:
        Qwen3.5-MoE's), sigmoid(h @ gate). Tensor parallel: this device's columns of every expert (a partial sum,
        reduced); never expert parallel. `choose(logits)` -> the routed (weights, ids) (DeepSeek's grouped routing,
        scaled); None: softmax top-k (renormalised when `renormalize`) times `scaling`, which a small step takes on
        the one-kernel front end (`moe_norm_route`). Router logits are rounded to the activations' dtype with
        `round_logits` (HF's F.linear), else kept float32 (DeepSeek's)."""
        from pallas_kernels.moe.moe_routing import moe_route_chosen, topk_routing, with_shared

        experts = weights[0].shape[0] - stacked
        gated = router.shape[1] != experts
        kernels = self._moe_kernels(weights[0].shape[1], weights[0].shape[2], *weights)
        slots = top_k + stacked
        front = choose is None and self._norm_route(
            x, norm, router, counters, kernels, top_k=top_k, renormalize=renormalize, eps=eps,
            round_logits=round_logits, scaling=scaling, shared=stacked, shared_gate=gated, experts=experts)
        if front:
            h, routing, counters = front
            out, _ = self._routed_experts(h, None, kernels, None, slots, experts + stacked, routing)
            ids = routing.topk_ids
        else:
            h = rms_norm(x, norm, eps)
            logits = self.project(h, router, preferred_element_type=jnp.float32)  # [T, E (+ the gate's block)]
            if round_logits:
                logits = logits.astype(h.dtype)
            if choose is None:
                w, ids = topk_routing(logits[:, :experts], top_k, renormalize)
                w = w * scaling
            else:
                w, ids = choose(logits[:, :experts])
            gate = jax.nn.sigmoid(logits[:, experts]).astype(jnp.float32) if gated else None
            if kernels:
                def route(block_m):
                    return moe_route_chosen(ids, w, num_experts=experts, block_m=block_m, shared=stacked,
                                            shared_weight=gate, interpret=self.interpret)

                out, routing = self._routed_experts(h, route, kernels, None, slots, experts + stacked)
            else:
                ids, w = with_shared(ids, w, experts, stacked, gate)
                out = moe_mlp(h, None, *weights, slots, renormalize, routed=(w, ids))
        x = x + self.reduce(out)
        if num_real is None:
            return x, counters
        return x, counters, expert_counts(ids, num_real, experts)

    def _norm_route(self, x, norm, router, counters, kernels, *, top_k: int, renormalize: bool, eps: float,
                    round_logits: bool = True, scaling: float = 1.0, shared: int = 0, shared_gate: bool = False,
                    experts: int | None = None) -> tuple | None:
        """A small step's norm, router and softmax routing as one kernel (`moe_norm_route`; with `shared` experts
        stacked after the routed ones, a gated router's gate, the routed weights' `scaling`): (h, routing, counters),
        or None where it does not run: no expert kernels (`kernels`: `_moe_kernels`'), no step counters, a step past
        `moe_front_max_tokens`, shapes it does not take, or x, norm and router in different dtypes. `experts`: the
        routed experts (default: the router's columns)."""
        tokens, hidden = x.shape
        experts = router.shape[1] if experts is None else experts
        if not kernels or counters is None or tokens > self.policy.moe_front_max_tokens \
                or not _front_supported(tokens, hidden, experts) \
                or not x.dtype == norm.dtype == getattr(router, "dtype", None):
            return None
        from pallas_kernels.moe.moe_router import GATE_COLUMNS, moe_norm_route

        launch = self.policy.launch_args("moe_norm_route")
        if shared_gate and GATE_COLUMNS % launch.get("block_e", 1):  # (an override whose tiles split the gate's block)
            return None
        return moe_norm_route(x, norm, router, counters, top_k=top_k, renormalize=renormalize,
                              block_m=moe_block_m(tokens * (top_k + shared), experts + shared), eps=eps,
                              round_logits=round_logits, scaling=scaling, shared=shared, shared_gate=shared_gate,
                              interpret=self.interpret, **launch)

    def _moe_kernels(self, hidden, inter, *weights) -> tuple | None:
        """The routed experts' operands for the grouped-GEMM kernels, as `dense.fp8_operands` gives them ((w_gate,
        w_up, w_down), block-FP8 scales or None, scale block); or None where they run on `layers.moe_mlp`: not the
        Pallas backend, dims not multiples of 16, FP8 weights the kernels cannot read (mixed, blocks under 16 rows,
        values not [E, out, in]: `Fp8Weight.transposed`, as fp8.kernel_layout keeps them)."""
        if self.backend != "pallas" or hidden % 16 or inter % 16:
            return None
        return fp8_operands("moe grouped GEMM", *weights, transposed=True)

    def _routed_experts(self, h, route, operands, first, top_k, router_experts, routing=None):
        """(The routed experts' weighted sum [T, hidden] of the normed rows h (this device's share when sharded) on
        the kernels, the step's whole `MoeRouting`, every device's experts). route(block_m): the step's `MoeRouting`
        in blocks of block_m rows; `routing`: one made already (the fused front end's, decode-sized), which the
        Triton GEMMs take. Steps routing at least
        `mosaic_moe_min_rows_per_expert` rows per expert run a Mosaic GPU grouped GEMM where it takes the shapes
        (bf16 experts moe_gemm_mgpu.py, block-FP8 [E, out, in] ones the e4m3 GEMM, moe_fp8_mgpu.py). `operands`:
        `_moe_kernels`'.
        `first`: the id of this device's first expert (expert parallel), or None."""
        from pallas_kernels.moe.moe_gemm import moe_combine, moe_down, moe_gate_up
        from pallas_kernels.moe.moe_routing import local_experts

        (w_gate, w_up, w_down), scales, block = operands
        tokens, num_experts = h.shape[0], w_gate.shape[0]
        pairs = tokens * top_k
        if routing is None and self.mosaic_prefill \
                and pairs >= self.policy.mosaic_moe_min_rows_per_expert * router_experts \
                and (mosaic := _mosaic_experts(h, (w_gate, w_up, w_down), scales, block)) is not None:
            block_m, experts = mosaic
            whole = routing = route(block_m)
            mine = None
            if first is not None:
                routing, mine = local_experts(routing, first, num_experts)
            return experts(h, routing, mine=mine, interpret=self.interpret), whole
        if routing is None:
            routing = route(moe_block_m(pairs, router_experts))
        whole, mine = routing, None
        if first is not None:
            routing, mine = local_experts(routing, first, num_experts)
        if scales is None:
            act = moe_gate_up(h, routing, w_gate, w_up, interpret=self.interpret)
            y = moe_down(act, routing, w_down, interpret=self.interpret)
        else:  # block-FP8 experts [E, out, in]: e4m3 tiles and their scales, met by e4m3 rows
            fp8 = {"scale_block": block, "interpret": self.interpret}
            act = moe_gate_up(h, routing, w_gate, w_up, scales[:2], **fp8)
            y = moe_down(act, routing, w_down, scales[2], **fp8)
        return moe_combine(y, top_k, h.dtype, mine), whole

    def shared_expert(self, h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                      gate: jax.Array | None = None) -> jax.Array:
        """A shared expert's output for the normed rows h [T, hidden]: SwiGLU (`DenseOps.swiglu`: the fused MLP kernel
        in small steps, else XLA or FP8's e4m3 GEMM), times sigmoid(h @ gate) per row where the model gates it
        (Qwen3.5-MoE's `shared_expert_gate`, [hidden, 1]). Sharded, its columns are this device's: a partial sum
        (the gate is replicated, so scaling before the block's psum is the same)."""
        y = self.swiglu(h, w_gate, w_up, w_down)
        return y if gate is None else jax.nn.sigmoid(h @ dense(gate, h.dtype)) * y


def expert_counts(ids: jax.Array, num_real: jax.Array, num_experts: int) -> jax.Array:
    """i32[num_experts]: the (token, top-k slot) pairs each expert got among the first `num_real` rows of the routed
    ids [T, k] (the step's real tokens; the padding rows after them are routed too, and not counted). A one-hot sum
    that XLA fuses into one reduction: no [T, k, E] array is written."""
    real = jnp.arange(ids.shape[0], dtype=jnp.int32) < num_real  # [T]
    hit = (ids[:, :, None] == jnp.arange(num_experts, dtype=ids.dtype)) & real[:, None, None]  # [T, k, E]
    return jnp.sum(hit, axis=(0, 1), dtype=jnp.int32)


def _front_supported(tokens: int, hidden: int, experts: int) -> bool:
    from pallas_kernels.moe.moe_router import front_supported

    return front_supported(tokens, hidden, experts) is None


def _mosaic_experts(h, weights, scales, block):
    """(block_m, experts(h, routing, mine=, interpret=)) of the Mosaic GPU grouped GEMM that takes these experts (bf16:
    moe_gemm_mgpu.py; block-FP8 [E, out, in] in 128 x 128 blocks: the e4m3 GEMM, moe_fp8_mgpu.py), or None."""
    if scales is None and _mgpu_supported(h, *weights):
        from pallas_kernels.moe.moe_gemm_mgpu import moe_experts_mgpu

        return MOSAIC_MOE_BLOCK_M, functools.partial(moe_experts_mgpu, w_gate=weights[0], w_up=weights[1],
                                                     w_down=weights[2])
    if scales is not None:
        from pallas_kernels.moe import moe_fp8_mgpu

        if moe_fp8_mgpu.supported(h.shape[1], weights[0].shape[1], block):  # ([E, out, in] values: I is axis 1)
            return moe_fp8_mgpu.BLOCK_M, functools.partial(moe_fp8_mgpu.moe_experts_fp8_mgpu, w_gate=weights[0],
                                                           w_up=weights[1], w_down=weights[2], scales=scales)
    return None


def _mgpu_supported(h, w_gate, w_up, w_down) -> bool:
    """Whether the Mosaic GPU grouped GEMM (`moe_gemm_mgpu.check_supported`) takes these shapes."""
    from pallas_kernels.moe.moe_gemm_mgpu import check_supported

    bm = MOSAIC_MOE_BLOCK_M
    up_spec = jax.ShapeDtypeStruct((bm, h.shape[1]), h.dtype)
    down_spec = jax.ShapeDtypeStruct((bm, w_down.shape[1]), h.dtype)
    return check_supported(up_spec, w_gate, w_up, block_m=bm) is None \
        and check_supported(down_spec, w_down, block_m=bm) is None
