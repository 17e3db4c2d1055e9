"""moe_route (one Pallas program) vs moe_route_reference (jnp), moe_route_chosen (DeepSeek's experts, chosen in XLA)
vs moe_route_chosen_reference, and the grouped layout's invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.layers import grouped_topk_routing
from pallas_kernels.moe.moe_routing import (
    ROUTE_KERNEL_MAX_TOKENS,
    moe_route,
    moe_route_chosen,
    moe_route_chosen_reference,
    moe_route_reference,
    num_blocks,
    topk_routing,
)
from tests.kernels.conftest import by_mode, lower_for_cuda, normal

CASES = [  # tokens, experts, top_k, block_m, renormalize
    pytest.param(1, 128, 8, 16, True, id="decode-b1"),
    pytest.param(16, 128, 8, 16, True, id="decode-b16"),
    pytest.param(64, 128, 8, 64, True, id="b64-m64"),
    pytest.param(5, 8, 2, 16, False, id="t5-no-renorm"),
    pytest.param(37, 60, 4, 8, True, id="e60-k4"),  # nothing a power of two
    pytest.param(3, 6, 6, 16, True, id="k-equals-e"),
]


def check_layout(r, tokens: int, experts: int, top_k: int, block_m: int, shared: int = 0) -> None:
    """Every pair sits exactly once in a block of its own expert; blocks are grouped by expert in order. `top_k`
    routed slots, then `shared` experts (ids experts + s) in every token's last slots."""
    ids = np.asarray(r.topk_ids)
    rows = np.asarray(r.pair_rows).ravel()
    bexp, brows = np.asarray(r.block_expert), np.asarray(r.block_rows)
    pairs = tokens * (top_k + shared)
    assert r.sorted_pairs.shape == (num_blocks(tokens * top_k, experts, block_m, tokens, shared) * block_m,)
    assert (ids[:, top_k:] == experts + np.arange(shared)).all()
    assert len(set(rows.tolist())) == rows.size
    assert (bexp[rows // block_m] == ids.ravel()).all(), "a pair sits in another expert's block"
    assert (rows % block_m < brows[rows // block_m]).all(), "a pair sits past its block's valid rows"
    assert brows.sum() == pairs
    assert (np.asarray(r.sorted_pairs)[rows] == np.arange(pairs)).all()
    used = bexp >= 0
    assert used[:used.sum()].all() and bexp[-1] == -1, "unused blocks come last (and the last one is spare)"
    assert (np.diff(bexp[used]) >= 0).all()


# The interpreter (one compile per case) leaves out decode-b16 (a full 16-token tile of 128 experts: b64-m64's
# 64 tokens fill theirs; a padded tile: decode-b1, e60-k4).
@pytest.mark.parametrize("mode,tokens,experts,top_k,block_m,renormalize",
                         by_mode([c for c in CASES if c.id != "decode-b16"], CASES))
def test_route_matches_reference(mode, tokens, experts, top_k, block_m, renormalize):
    logits = normal(np.random.default_rng(tokens * experts + top_k), (tokens, experts), scale=2.0)
    r = moe_route(logits, top_k=top_k, renormalize=renormalize, block_m=block_m, interpret=mode == "interpret")
    ref = moe_route_reference(logits, top_k=top_k, renormalize=renormalize, block_m=block_m)
    for field in ("topk_ids", "pair_rows", "block_expert", "block_rows"):
        np.testing.assert_array_equal(getattr(r, field), getattr(ref, field), err_msg=field)
    np.testing.assert_allclose(r.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-7)
    assert (np.diff(np.asarray(r.topk_weights), axis=1) <= 1e-7).all(), "experts best first"
    check_layout(r, tokens, experts, top_k, block_m)
    check_layout(ref, tokens, experts, top_k, block_m)


# DeepSeek-V2-Lite's routing (softmax, 64 experts, top-6, one group) and V3's (sigmoid + correction bias, 256 experts
# in 8 groups, the best 4 kept, top-8, renormalised, scaled by 2.5)
V2_LITE = dict(top_k=6, n_group=1, topk_group=1, sigmoid=False, renormalize=False, scaling=1.0)
V3 = dict(top_k=8, n_group=8, topk_group=4, sigmoid=True, renormalize=True, scaling=2.5)
CHOSEN = [  # tokens, experts, block_m, routing
    pytest.param(1, 64, 16, V2_LITE, id="v2-lite-b1"),
    pytest.param(5, 256, 16, V3, id="v3-t5"),
    pytest.param(64, 64, 64, V2_LITE, id="v2-lite-b64-m64"),
    pytest.param(64, 256, 16, V3, id="v3-b64"),
    pytest.param(1, 256, 16, V3, id="v3-b1"),
    pytest.param(5, 64, 16, V2_LITE, id="v2-lite-t5"),
]


def grouped_choice(tokens, experts, kw):
    rng = np.random.default_rng(tokens * experts)
    logits = normal(rng, (tokens, experts), scale=2.0)
    bias = normal(rng, (experts,)) if kw["sigmoid"] else None
    return grouped_topk_routing(logits, bias, **kw)


# The interpreter leaves out the last two (the b1 and t5 tiles again, with the other expert count).
@pytest.mark.parametrize("mode,tokens,experts,block_m,kw", by_mode(CHOSEN[:4], CHOSEN))
def test_route_chosen_matches_reference(mode, tokens, experts, block_m, kw):
    weights, ids = grouped_choice(tokens, experts, kw)
    r = moe_route_chosen(ids, weights, num_experts=experts, block_m=block_m, interpret=mode == "interpret")
    ref = moe_route_chosen_reference(ids, weights, num_experts=experts, block_m=block_m)
    for field in ("topk_ids", "topk_weights", "pair_rows", "block_expert", "block_rows"):
        np.testing.assert_array_equal(getattr(r, field), getattr(ref, field), err_msg=field)
    np.testing.assert_array_equal(r.topk_ids, ids)
    check_layout(r, tokens, experts, kw["top_k"], block_m)


SHARED = [  # tokens, experts, block_m, routing, shared experts
    pytest.param(1, 64, 16, V2_LITE, 2, id="v2-lite-b1-2-shared"),
    pytest.param(37, 60, 8, dict(V2_LITE, top_k=4), 3, id="t37-e60-3-shared"),  # several blocks per shared expert
    pytest.param(16, 256, 16, V3, 1, id="v3-b16-1-shared"),
]


@pytest.mark.parametrize("mode,tokens,experts,block_m,kw,shared", by_mode(SHARED[:2], SHARED))
def test_route_chosen_with_shared_experts_matches_reference(mode, tokens, experts, block_m, kw, shared):
    """Shared experts stacked after the routed ones: the kernel lays them out itself (no [T, E + S] tiles), as the
    reference lays out any chosen experts over E + S, with their weights (1 or given per token) in the last slots."""
    weights, ids = grouped_choice(tokens, experts, kw)
    sw = jnp.asarray(np.random.default_rng(tokens).uniform(0.1, 0.9, tokens), jnp.float32) if shared != 2 else None
    r = moe_route_chosen(ids, weights, num_experts=experts, block_m=block_m, shared=shared, shared_weight=sw,
                         interpret=mode == "interpret")
    ref = moe_route_chosen_reference(ids, weights, num_experts=experts, block_m=block_m, shared=shared,
                                     shared_weight=sw)
    for field in ("topk_ids", "topk_weights", "pair_rows", "block_expert", "block_rows"):
        np.testing.assert_array_equal(getattr(r, field), getattr(ref, field), err_msg=field)
    check_layout(r, tokens, experts, kw["top_k"], block_m, shared)
    want = np.ones((tokens, shared)) if sw is None else np.repeat(np.asarray(sw)[:, None], shared, 1)
    np.testing.assert_array_equal(np.asarray(r.topk_weights)[:, kw["top_k"]:], want)


def test_route_chosen_of_top_k_is_moe_route():
    """Given moe_route's own top-k, the layout is moe_route's (the jnp forms; the kernels match them above)."""
    logits = normal(np.random.default_rng(2), (37, 60))
    r = moe_route_reference(logits, top_k=4, block_m=8)
    chosen = moe_route_chosen_reference(r.topk_ids, r.topk_weights, num_experts=60, block_m=8)
    for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(chosen), strict=True):
        np.testing.assert_array_equal(a, b)


def test_topk_routing_is_hfs():
    """softmax in float32 over all experts, top-k, renormalised (numpy, independently)."""
    logits = np.random.default_rng(0).standard_normal((7, 12)).astype(np.float32)
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :3]
    w = np.take_along_axis(p, ids, 1)
    got_w, got_ids = topk_routing(jnp.asarray(logits), 3, False)
    np.testing.assert_array_equal(got_ids, ids)
    np.testing.assert_allclose(got_w, w, rtol=1e-6)
    got_w, _ = topk_routing(jnp.asarray(logits), 3, True)
    np.testing.assert_allclose(got_w, w / w.sum(1, keepdims=True), rtol=1e-6)


def test_large_steps_take_the_xla_path():
    tokens = ROUTE_KERNEL_MAX_TOKENS + 1
    logits = normal(np.random.default_rng(1), (tokens, 16))
    r = moe_route(logits, top_k=2, block_m=16, interpret=True)
    check_layout(r, tokens, 16, 2, 16)
    r = moe_route_chosen(r.topk_ids, r.topk_weights, num_experts=16, block_m=16, interpret=True)
    check_layout(r, tokens, 16, 2, 16)


@pytest.mark.parametrize("kw, match", [
    ({"top_k": 0}, "top_k"), ({"top_k": 9}, "top_k"), ({"block_m": 12}, "block_m"),
])
def test_argument_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        moe_route(jnp.zeros((4, 8)), **{"top_k": 2, "block_m": 16, **kw})
    with pytest.raises(ValueError, match="logits"):
        moe_route(jnp.zeros((4,)), top_k=2)
    ids = jnp.zeros((4, kw.get("top_k", 2)), jnp.int32)
    with pytest.raises(ValueError, match=match):
        moe_route_chosen(ids, ids.astype(jnp.float32), num_experts=8, block_m=kw.get("block_m", 16))


def test_route_chosen_argument_errors():
    ids = jnp.zeros((4, 2), jnp.int32)
    for bad in (ids.astype(jnp.float32), ids[:, 0], ids.astype(jnp.int16)):
        with pytest.raises(ValueError, match="topk_ids"):
            moe_route_chosen(bad, ids.astype(jnp.float32), num_experts=8)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_route_chosen(ids, jnp.zeros((4, 3)), num_experts=8)


def test_route_lowers_for_cuda():
    text = lower_for_cuda(lambda lg: moe_route(lg, top_k=8, block_m=16),
                          jax.ShapeDtypeStruct((ROUTE_KERNEL_MAX_TOKENS, 128), jnp.bfloat16))
    assert "moe_route_t256_e128_k8_m16" in text


def test_route_chosen_lowers_for_cuda():
    shape = jax.ShapeDtypeStruct((ROUTE_KERNEL_MAX_TOKENS, 6), jnp.int32)
    text = lower_for_cuda(lambda i, w: moe_route_chosen(i, w, num_experts=64, block_m=16), shape,
                          jax.ShapeDtypeStruct(shape.shape, jnp.float32))
    assert "moe_route_chosen_t256_e64_k6_m16" in text
