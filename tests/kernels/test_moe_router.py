"""moe_norm_route (one Pallas kernel: RMSNorm + router projection + routing) vs XLA's norm and dot and the jnp
routing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.moe_router import MAX_TOKENS, gated_router, moe_norm_route, moe_norm_router_reference
from pallas_kernels.moe.moe_routing import moe_route_chosen_reference, moe_route_reference, topk_routing
from tests.kernels.conftest import by_mode, lower_for_cuda, normal
from tests.kernels.test_moe_routing import check_layout


def inputs(tokens, hidden, experts, dtype):
    rng = np.random.default_rng(tokens * hidden + experts)
    x = normal(rng, (tokens, hidden), dtype, 3.0)
    norm = normal(rng, (hidden,), dtype, 0.1, loc=1.0)
    router = normal(rng, (hidden, experts), dtype, 1 / np.sqrt(hidden))
    return x, norm, router


FRONT_CASES = [  # tokens, hidden, experts, top_k, block_m, renormalize, dtype
    pytest.param(1, 2048, 128, 8, 16, True, jnp.bfloat16, id="qwen3-30b-a3b-b1"),
    pytest.param(8, 2048, 128, 8, 16, True, jnp.bfloat16, id="qwen3-30b-a3b-b8"),
    pytest.param(37, 256, 64, 4, 16, False, jnp.bfloat16, id="t37-no-renorm"),
    pytest.param(3, 64, 8, 2, 16, True, jnp.float32, id="f32-8-experts"),
    pytest.param(MAX_TOKENS, 128, 24, 6, 64, True, jnp.float32, id="f32-max-tokens-e24"),
]


def front_reference(x, norm, router, *, top_k, renormalize, block_m, eps=1e-6):
    h, logits = moe_norm_router_reference(x, norm, router, eps=eps)
    return h, logits, moe_route_reference(logits, top_k=top_k, renormalize=renormalize, block_m=block_m)


def check_routing_matches(r, ref, logits_ref, tokens, experts, top_k, block_m, renormalize=True):
    """Each token's experts are a top-k of the reference logits, best first, up to near-ties (the kernel sums the
    logits in another order before rounding them: one may land one ulp apart and flip a tie), with the reference's
    weights for those experts; where no token has a near-tie, the whole routing equals the reference's."""
    check_layout(r, tokens, experts, top_k, block_m)
    lg = np.asarray(logits_ref, np.float64)
    ids = np.asarray(r.topk_ids)
    tol = 2 * 2.0 ** -8 * np.abs(lg).max()  # two bf16 ulps of the largest logit
    chosen = np.take_along_axis(lg, ids, 1)  # [T, k]
    others = np.where(_mask_out(lg, ids), lg, -np.inf)
    assert (chosen.min(1) >= others.max(1) - tol).all(), "an expert outside the top-k was picked"
    assert (np.diff(chosen, axis=1) <= tol).all(), "experts not best first"
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    w = np.take_along_axis(p, ids, 1)
    if renormalize:
        w = w / w.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(r.topk_weights), w, rtol=2e-2, atol=1e-4)
    top = -np.sort(-lg, axis=1)[:, :top_k + 1]
    if (np.diff(top, axis=1) < -tol).all():
        for field in ("topk_ids", "pair_rows", "block_expert", "block_rows"):
            np.testing.assert_array_equal(getattr(r, field), getattr(ref, field), err_msg=field)


def _mask_out(lg, ids):
    """[T, E] True where the expert is not among the token's ids."""
    keep = np.ones(lg.shape, bool)
    np.put_along_axis(keep, ids, False, 1)
    return keep


# The interpreter (one compile per case) leaves out qwen3-30b-a3b-b1 (Qwen3-30B-A3B's shapes: the b8 case; a token
# tile mostly padding: f32-8-experts' 3 tokens, t37's last tile).
@pytest.mark.parametrize("mode,tokens,hidden,experts,top_k,block_m,renormalize,dtype",
                         by_mode([c for c in FRONT_CASES if c.id != "qwen3-30b-a3b-b1"], FRONT_CASES))
def test_norm_route_matches_xla(mode, tokens, hidden, experts, top_k, block_m, renormalize, dtype):
    x, norm, router = inputs(tokens, hidden, experts, dtype)
    counters = jnp.zeros((16,), jnp.int32)
    h, r, counters = moe_norm_route(x, norm, router, counters, top_k=top_k, renormalize=renormalize,
                                    block_m=block_m, eps=1e-6, interpret=mode == "interpret")
    h_ref, logits_ref, ref = front_reference(x, norm, router, top_k=top_k, renormalize=renormalize, block_m=block_m)
    ulp = 2.0 ** -8 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(h.astype(jnp.float32)), np.asarray(h_ref.astype(jnp.float32)), rtol=ulp)
    check_routing_matches(r, ref, logits_ref, tokens, experts, top_k, block_m, renormalize)
    assert not np.asarray(counters).any(), "the kernel must leave its counter zero"


# The extremes: the smallest tiles unsplit (several expert blocks, 64 K steps), one block of all 64 experts with
# 16 K splits of 64 columns. ((16, 64, 4) and (32, 128, 2) lie between them.)
@pytest.mark.parametrize("block_e,block_k,k_splits", [(16, 16, 1), (64, 16, 16)])
def test_norm_route_tilings_agree(block_e, block_k, k_splits):
    x, norm, router = inputs(5, 1024, 64, jnp.float32)
    kw = dict(top_k=4, renormalize=True, block_m=16, eps=1e-6, interpret=True)
    counters = jnp.zeros((4,), jnp.int32)
    h, r, counters = moe_norm_route(x, norm, router, counters, block_e=block_e, block_k=block_k, k_splits=k_splits,
                                    **kw)
    h0, r0, _ = moe_norm_route(x, norm, router, counters, **kw)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h0), rtol=1e-6)  # block_k orders the norm's sum
    for field in ("topk_ids", "pair_rows", "block_expert", "block_rows"):
        np.testing.assert_array_equal(getattr(r, field), getattr(r0, field), err_msg=field)
    np.testing.assert_allclose(r.topk_weights, r0.topk_weights, rtol=1e-5)


def test_norm_route_chained_calls_share_counters():
    """Layers pass one counters buffer along: each call finds counter 0 zero (a dirty one would leave the
    routing unwritten)."""
    kw = dict(top_k=2, renormalize=True, block_m=16, eps=1e-6, interpret=True)
    counters = jnp.zeros((2,), jnp.int32)
    x, norm, router = inputs(3, 128, 16, jnp.float32)
    for seed in range(3):  # one shape (one compile), other inputs each time
        x, norm, router = (a * (1 + 0.5 * seed) if a.ndim == 2 else a for a in (x, norm, router[:, ::-1]))
        h, r, counters = moe_norm_route(x, norm, router, counters, **kw)
        _, logits_ref, ref = front_reference(x, norm, router, top_k=2, renormalize=True, block_m=16)
        check_routing_matches(r, ref, logits_ref, 3, 16, 2, 16)
    assert not np.asarray(counters).any()


def test_norm_route_fp32_logits():
    """round_logits=False (DeepSeek-V2's float32 router): the routing of the unrounded logits, weights within float32
    summation order of their softmax (the bf16-rounded logits would be ~1e-3 off)."""
    tokens, hidden, experts, top_k = 5, 256, 64, 6
    x, norm, router = inputs(tokens, hidden, experts, jnp.bfloat16)
    kw = dict(top_k=top_k, renormalize=False, block_m=16)
    h, r, _ = moe_norm_route(x, norm, router, jnp.zeros((1,), jnp.int32), eps=1e-6, round_logits=False,
                             interpret=True, **kw)
    h_ref, logits = moe_norm_router_reference(x, norm, router, eps=1e-6, round_logits=False)
    ref = moe_route_reference(logits, **kw)
    np.testing.assert_array_equal(np.asarray(h.astype(jnp.float32)), np.asarray(h_ref.astype(jnp.float32)))
    check_routing_matches(r, ref, logits, tokens, experts, top_k, 16, renormalize=False)
    lg = np.asarray(logits, np.float64)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    np.testing.assert_allclose(np.asarray(r.topk_weights), np.take_along_axis(p, np.asarray(r.topk_ids), 1),
                               rtol=1e-4)


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,scaling,shared,gated,tiles", [
    # the gate's partial sums over 2 K splits (the default tiling has one at hidden 64)
    pytest.param(3, 8, 2, True, 1.0, 2, True, dict(block_k=32, k_splits=2), id="qwen3.5-moe-gated-2-splits"),
    pytest.param(20, 24, 6, False, 2.5, 1, False, {}, id="deepseek-scaled-t20"),  # two blocks of the shared expert
])
def test_norm_route_with_shared_experts(tokens, experts, top_k, renormalize, scaling, shared, gated, tiles):
    """Shared experts stacked after the routed ones take every token's last slots, weighted 1 or sigmoid(h @ gate)
    (the router's gate column block, `gated_router`); the routed weights carry the scaling: the routing equals the
    reference's top-k of the routed logits, scaled, with the shared experts laid out by moe_route_chosen_reference."""
    hidden, block_m = 64, 16
    x, norm, router = inputs(tokens, hidden, experts, jnp.float32)
    gate = normal(np.random.default_rng(5), (hidden, 1), jnp.float32, 1 / np.sqrt(hidden))
    h, r, counters = moe_norm_route(x, norm, gated_router(router, gate) if gated else router,
                                    jnp.zeros((1,), jnp.int32), top_k=top_k, renormalize=renormalize,
                                    block_m=block_m, eps=1e-6, scaling=scaling, shared=shared, shared_gate=gated,
                                    interpret=True, **tiles)
    h_ref, logits = moe_norm_router_reference(x, norm, router, eps=1e-6)
    w, ids = topk_routing(logits, top_k, renormalize)
    sw = jax.nn.sigmoid(jnp.dot(h_ref, gate, precision=jax.lax.Precision.HIGHEST))[:, 0] if gated else None
    ref = moe_route_chosen_reference(ids, w * scaling, num_experts=experts, block_m=block_m, shared=shared,
                                     shared_weight=sw)
    np.testing.assert_allclose(np.asarray(h), np.asarray(h_ref), rtol=1e-6, atol=1e-6)
    for field in ("topk_ids", "pair_rows", "block_expert", "block_rows"):
        np.testing.assert_array_equal(getattr(r, field), getattr(ref, field), err_msg=field)
    np.testing.assert_allclose(np.asarray(r.topk_weights), np.asarray(ref.topk_weights), rtol=1e-5, atol=1e-6)
    check_layout(r, tokens, experts, top_k, block_m, shared)
    assert int(counters[0]) == 0


def test_norm_route_bad_arguments_are_value_errors():
    x, norm, router = inputs(2, 64, 8, jnp.float32)
    c = jnp.zeros((1,), jnp.int32)
    kw = dict(top_k=2, renormalize=True, block_m=16, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="tokens"):
        moe_norm_route(jnp.zeros((MAX_TOKENS + 1, 64)), norm, router, c, **kw)
    with pytest.raises(ValueError, match="x must be"):
        moe_norm_route(x[0], norm, router, c, **kw)
    with pytest.raises(ValueError, match="top_k"):
        moe_norm_route(x, norm, router, c, **{**kw, "top_k": 9})
    with pytest.raises(ValueError, match="block_m"):
        moe_norm_route(x, norm, router, c, **{**kw, "block_m": 24})
    with pytest.raises(ValueError, match="counters"):
        moe_norm_route(x, norm, router, c.astype(jnp.float32), **kw)
    with pytest.raises(ValueError, match="k_splits"):
        moe_norm_route(x, norm, router, c, k_splits=8, block_k=16, **kw)


def test_norm_route_lowers_for_the_gpu():
    text = lower_for_cuda(
        lambda x, n, w, c: moe_norm_route(x, n, w, c, top_k=8, renormalize=True, block_m=16, eps=1e-6),
        jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
        jax.ShapeDtypeStruct((2048, 128), jnp.bfloat16), jax.ShapeDtypeStruct((16,), jnp.int32))
    assert "moe_norm_route_t16_e16_k256_s4" in text
