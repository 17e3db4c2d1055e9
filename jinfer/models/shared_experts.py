"""Shared experts stacked after the routed ones: the MoE layers' shared SwiGLU (DeepSeekMoE's
`num_shared_experts` experts as one MLP, Qwen3.5-MoE's gated shared expert) cut into experts of the routed width
and appended to the routed experts' weights, so a decode step's grouped GEMMs run them in the same launches as the
routed experts (`ModelOps.moe_block`'s `stacked`), at their bandwidth, where a separate shared MLP ran below it
(Qwen3.5-35B-A3B's 2048 x 512 shared expert: 15 us a layer for 6 MB, its routed experts 2.9-3.0 TB/s).

A SwiGLU is a sum over its intermediate columns, so any split of them into groups is exact: columns
[s * I, (s + 1) * I) become stacked expert s (the last one zero-padded when I does not divide the shared width:
silu(0) * 0 = 0). Qwen3.5-MoE's gate becomes the router's column E, padded to a block of GATE_COLUMNS
(`moe_router.gated_router`): its sigmoid weighs the stacked experts.

Under tensor parallel the stacked experts split by their intermediate columns as the routed ones: any partition of
the shared columns over the devices is exact too (each device sums its columns, the layer's reduction adds the
devices). Kept apart: FP8 weights (block scales), expert parallel (`registry.shard_weights` does not stack there),
layers without shared experts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jinfer.models.fp8 import Fp8Weight


def stacked_count(layer, num_experts: int) -> int:
    """Shared experts stacked after the routed ones in this layer's expert weights (0: none, a dense layer, or a
    device's share of the experts under expert parallel, which never has them stacked)."""
    w = layer.w_gate
    return max(w.shape[0] - num_experts, 0) if getattr(w, "ndim", 0) == 3 else 0


def _stack(w_gate, w_up, w_down, ws_gate, ws_up, ws_down):
    experts, hidden, inter = w_gate.shape
    count = -(-ws_gate.shape[1] // inter)
    pad = count * inter - ws_gate.shape[1]

    def columns(w):  # [hidden, I_shared] -> [count, hidden, inter]
        w = jnp.pad(w, ((0, 0), (0, pad)))
        return w.reshape(hidden, count, inter).transpose(1, 0, 2).astype(w_gate.dtype)

    down = jnp.pad(ws_down, ((0, pad), (0, 0))).reshape(count, inter, hidden).astype(w_down.dtype)
    return (jnp.concatenate([w_gate, columns(ws_gate)]), jnp.concatenate([w_up, columns(ws_up)]),
            jnp.concatenate([w_down, down]))


def stack_shared_experts(weights, num_experts: int):
    """The weights with every MoE layer's shared experts stacked after its `num_experts` routed ones (module doc);
    layers that cannot be are kept, each new array sharded as the routed experts were. On a GPU the routed and shared
    arrays are consumed: deleted once a layer's new experts are made, so the peak grows by one layer's experts, not
    by all of them (the caller's `weights` still holds the old layers until this returns). On CPU they are left."""
    from pallas_kernels.moe.moe_router import gated_router

    consume = jax.default_backend() != "cpu"
    jits = {}  # by the experts' shardings: their new arrays keep them
    layers = []
    for layer in weights.layers:
        parts = (layer.w_gate, layer.w_up, layer.w_down, getattr(layer, "ws_gate", None), getattr(layer, "ws_up", None),
                 getattr(layer, "ws_down", None))
        if any(p is None or isinstance(p, Fp8Weight) for p in parts) or parts[0].ndim != 3 \
                or parts[0].shape[0] != num_experts or isinstance(getattr(layer, "shared_gate", None), Fp8Weight):
            layers.append(layer)
            continue
        key = tuple(p.sharding for p in parts[:3])
        stack = jits.get(key) or jits.setdefault(key, jax.jit(_stack, out_shardings=key))
        w_gate, w_up, w_down = stack(*parts)
        if consume:  # (new shapes: a donation could not reuse them, and the old layer object still holds them)
            for p in parts:
                p.delete()
        new = dict(w_gate=w_gate, w_up=w_up, w_down=w_down, ws_gate=None, ws_up=None, ws_down=None)
        if getattr(layer, "shared_gate", None) is not None:
            router = jax.device_put(gated_router(layer.router, layer.shared_gate), layer.router.sharding)
            new |= dict(router=router, shared_gate=None)
        layers.append(dataclasses.replace(layer, **new))
    return dataclasses.replace(weights, layers=layers)
