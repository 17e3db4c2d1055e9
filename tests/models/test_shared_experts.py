"""Shared experts stacked after the routed ones (jinfer/models/shared_experts.py): the MoE blocks on the stacked
weights (the Pallas ops, interpreted: the one-kernel front end at 1 token, the routing kernel past
`moe_front_max_tokens`; the reference ops) give the output of the reference block with the shared MLP apart (the path
the HF goldens check), for Qwen3.5-MoE's gated shared expert (a width the routed one does not divide: zero-padded)
and DeepSeek's scaled routing (V2-Lite's softmax, V3's grouped sigmoid)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.shared_experts import stack_shared_experts, stacked_count
from jinfer.ops import REFERENCE_OPS, ModelOps
from tests.kernels.conftest import normal

E, HIDDEN, INTER, TOP_K = 8, 64, 32, 2
PALLAS = ModelOps("pallas", interpret=True)


@dataclasses.dataclass
class Layer:
    w_gate: jax.Array
    w_up: jax.Array
    w_down: jax.Array
    router: jax.Array
    ws_gate: jax.Array | None = None
    ws_up: jax.Array | None = None
    ws_down: jax.Array | None = None
    shared_gate: jax.Array | None = None


@dataclasses.dataclass
class Weights:
    layers: list


def layer(shared_inter: int, gated: bool, seed: int = 0) -> Layer:
    rng = np.random.default_rng(seed)
    w = lambda s, scale=1.0: normal(rng, s, jnp.float32, scale * s[-2] ** -0.5)  # noqa: E731
    return Layer(w((E, HIDDEN, INTER)), w((E, HIDDEN, INTER)), w((E, INTER, HIDDEN)), w((HIDDEN, E), 4.0),
                 w((HIDDEN, shared_inter)), w((HIDDEN, shared_inter)), w((shared_inter, HIDDEN)),
                 w((HIDDEN, 1), 2.0) if gated else None)


def stacked(plain: Layer) -> Layer:
    """The layer stacked from copies (on a GPU the stacking consumes the arrays it reads)."""
    copies = {f.name: jnp.array(v, copy=True) for f in dataclasses.fields(plain)
              if (v := getattr(plain, f.name)) is not None}
    (out,) = stack_shared_experts(Weights([dataclasses.replace(plain, **copies)]), E).layers
    return out


def inputs(tokens):
    rng = np.random.default_rng(tokens)
    return normal(rng, (tokens, HIDDEN), jnp.float32, 2.0), normal(rng, (HIDDEN,), jnp.float32, 0.1, loc=1.0)


def test_stacking_layout():
    """48 shared columns over experts of 32: two stacked experts, the second's last 16 columns zero; the gate becomes
    the router's column E (then zeros to a block of 16); the unstacked fields are gone."""
    plain = layer(48, gated=True)
    s = stacked(plain)
    assert s.w_gate.shape == (E + 2, HIDDEN, INTER) and s.w_down.shape == (E + 2, INTER, HIDDEN)
    assert stacked_count(s, E) == 2 and stacked_count(plain, E) == 0
    np.testing.assert_array_equal(s.w_gate[E + 1, :, :16], plain.ws_gate[:, 32:])
    np.testing.assert_array_equal(s.w_gate[E + 1, :, 16:], 0)
    np.testing.assert_array_equal(s.w_down[E], plain.ws_down[:32])
    np.testing.assert_array_equal(s.router[:, :E], plain.router)
    np.testing.assert_array_equal(s.router[:, E], plain.shared_gate[:, 0])
    assert s.router.shape == (HIDDEN, E + 16) and not np.asarray(s.router[:, E + 1:]).any()
    assert s.ws_gate is None and s.shared_gate is None


@pytest.mark.parametrize("tokens", [1, 12], ids=["front-kernel", "routing-kernel"])
def test_qwen3_5_gated_shared_expert(tokens):
    plain = layer(48, gated=True)
    s = stacked(plain)
    x, norm = inputs(tokens)
    kw = dict(top_k=TOP_K, renormalize=True, eps=1e-6)
    want, _ = REFERENCE_OPS.moe_block(x, norm, plain.router, plain.w_gate, plain.w_up, plain.w_down,
                                      shared=(plain.ws_gate, plain.ws_up, plain.ws_down, plain.shared_gate), **kw)
    real = jnp.int32(tokens - 1)  # (the expert-load recorder's real rows: the last one is padding)
    _, _, want_counts = REFERENCE_OPS.moe_block(x, norm, plain.router, plain.w_gate, plain.w_up, plain.w_down,
                                                num_real=real, **kw)
    for ops in (PALLAS, REFERENCE_OPS):
        counters = ops.step_counters(tokens)
        got, counters, counts = ops.moe_block(x, norm, s.router, s.w_gate, s.w_up, s.w_down, counters=counters,
                                              stacked=2, num_real=real, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
        assert counters is None or not np.asarray(counters).any()
        np.testing.assert_array_equal(counts, want_counts)  # the routed experts only
        assert int(np.sum(counts)) == (tokens - 1) * TOP_K


def test_qwen3_5_front_kernel_takes_the_shared_expert():
    """A one-token step on the Pallas ops: the norm, router, routing and the shared expert's gate in the front kernel,
    the experts in one grouped GEMM pair, no fused MLP (the shared expert's former kernel) and no XLA dot."""
    s = stacked(layer(48, gated=True))
    x, norm = inputs(1)
    jaxpr = str(jax.make_jaxpr(lambda x: PALLAS.moe_block(x, norm, s.router, s.w_gate, s.w_up, s.w_down, top_k=TOP_K,
                                                          renormalize=True, eps=1e-6, stacked=2,
                                                          counters=PALLAS.step_counters(1))[0])(x))
    assert "moe_norm_route" in jaxpr and "_sh2" in jaxpr and "fused_swiglu" not in jaxpr
    assert "dot_general" not in jaxpr.split("moe_norm_route")[0]


V2_LITE = dict(top_k=TOP_K, n_group=1, topk_group=1, sigmoid=False, renormalize=False, scaling=1.5)
V3 = dict(top_k=TOP_K, n_group=4, topk_group=2, sigmoid=True, renormalize=True, scaling=2.5)


@pytest.mark.parametrize("tokens", [1, 12], ids=["t1", "t12"])
@pytest.mark.parametrize("routing", [V2_LITE, V3], ids=["v2-lite", "v3"])
def test_deepseek_shared_experts(tokens, routing):
    """DeepSeekMoE's two shared experts (one SwiGLU of twice the expert width), weight 1 beside the scaled routed
    ones; V2-Lite's softmax routing takes the front kernel at one token, with its scaling inside."""
    plain = layer(2 * INTER, gated=False, seed=1)
    s = stacked(plain)
    x, norm = inputs(tokens)
    bias = normal(np.random.default_rng(3), (E,), jnp.float32) if routing["sigmoid"] else None
    kw = dict(eps=1e-6, **routing)
    want, _ = REFERENCE_OPS.grouped_moe_block(x, norm, plain.router, bias, plain.w_gate, plain.w_up, plain.w_down,
                                              (plain.ws_gate, plain.ws_up, plain.ws_down), **kw)
    for ops in (PALLAS, REFERENCE_OPS):
        got, _ = ops.grouped_moe_block(x, norm, s.router, bias, s.w_gate, s.w_up, s.w_down, None,
                                       counters=ops.step_counters(tokens), stacked=2, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_fp8_and_unshared_layers_are_kept():
    from jinfer.models.fp8 import quantize

    plain = layer(32, gated=False)
    fp8 = dataclasses.replace(plain, ws_gate=quantize(plain.ws_gate, (16, 16)))
    dense = Layer(plain.ws_gate, plain.ws_up, plain.ws_down, plain.router)  # a dense layer's [hidden, I] weights
    out = stack_shared_experts(Weights([fp8, dense]), E).layers
    assert out[0] is fp8 and out[1] is dense


def test_packed_buffers_are_given_back_only_after_their_step():
    """The sampler's packed-samples buffers (ModelRunner._packed_out, a RecycledBuffers): a new one while every
    earlier one is still out, the one given back (after its step's read-back, `fetch`) next, per shape."""
    from jinfer.engine.step_inputs import packed_shape
    from jinfer.parallel.mesh import RecycledBuffers

    pool = RecycledBuffers(jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    a, b = (pool.take(packed_shape(2, -1)) for _ in range(2))
    assert a is not b and a.shape == (2, 3)
    pool.give_back(a)
    assert pool.take(packed_shape(2, 4)).shape == (2, 11)  # another shape: a new buffer
    assert pool.take(packed_shape(2, -1)) is a
    c = pool.take(packed_shape(2, -1))
    assert c is not a and c is not b
