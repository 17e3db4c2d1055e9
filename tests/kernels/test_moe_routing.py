"""moe_route (one Pallas program) vs moe_route_reference (jnp), and the grouped layout's invariants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe.moe_routing import (
    ROUTE_KERNEL_MAX_TOKENS,
    moe_route,
    moe_route_reference,
    num_blocks,
    topk_routing,
)
from tests.kernels.conftest import by_mode, lower_for_cuda

CASES = [  # tokens, experts, top_k, block_m, renormalize
    pytest.param(1, 128, 8, 16, True, id="decode-b1"),
    pytest.param(16, 128, 8, 16, True, id="decode-b16"),
    pytest.param(64, 128, 8, 64, True, id="b64-m64"),
    pytest.param(5, 8, 2, 16, False, id="t5-no-renorm"),
    pytest.param(37, 60, 4, 8, True, id="e60-k4"),  # nothing a power of two
    pytest.param(3, 6, 6, 16, True, id="k-equals-e"),
]


def check_layout(r, tokens: int, experts: int, top_k: int, block_m: int) -> None:
    """Every pair sits exactly once in a block of its own expert; blocks are grouped by expert in order."""
    ids = np.asarray(r.topk_ids)
    rows = np.asarray(r.pair_rows).ravel()
    bexp, brows = np.asarray(r.block_expert), np.asarray(r.block_rows)
    assert r.sorted_pairs.shape == (num_blocks(tokens * top_k, experts, block_m) * block_m,)
    assert len(set(rows.tolist())) == rows.size
    assert (bexp[rows // block_m] == ids.ravel()).all(), "a pair sits in another expert's block"
    assert (rows % block_m < brows[rows // block_m]).all(), "a pair sits past its block's valid rows"
    assert brows.sum() == tokens * top_k
    assert (np.asarray(r.sorted_pairs)[rows] == np.arange(tokens * top_k)).all()
    used = bexp >= 0
    assert used[:used.sum()].all() and bexp[-1] == -1, "unused blocks come last (and the last one is spare)"
    assert (np.diff(bexp[used]) >= 0).all()
    w = np.asarray(r.topk_weights)
    assert (np.diff(w, axis=1) <= 1e-7).all(), "experts best first"


# The interpreter (one compile per case) leaves out decode-b16 (a full 16-token tile of 128 experts: b64-m64's
# 64 tokens fill theirs; a padded tile: decode-b1, e60-k4).
@pytest.mark.parametrize("mode,tokens,experts,top_k,block_m,renormalize",
                         by_mode([c for c in CASES if c.id != "decode-b16"], CASES))
def test_route_matches_reference(mode, tokens, experts, top_k, block_m, renormalize):
    logits = jax.random.normal(jax.random.key(tokens * experts + top_k), (tokens, experts), jnp.float32) * 2
    r = moe_route(logits, top_k=top_k, renormalize=renormalize, block_m=block_m, interpret=mode == "interpret")
    ref = moe_route_reference(logits, top_k=top_k, renormalize=renormalize, block_m=block_m)
    for field in ("topk_ids", "pair_rows", "block_expert", "block_rows"):
        np.testing.assert_array_equal(getattr(r, field), getattr(ref, field), err_msg=field)
    np.testing.assert_allclose(r.topk_weights, ref.topk_weights, rtol=1e-5, atol=1e-7)
    check_layout(r, tokens, experts, top_k, block_m)
    check_layout(ref, tokens, experts, top_k, block_m)


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
    logits = jax.random.normal(jax.random.key(1), (tokens, 16))
    r = moe_route(logits, top_k=2, block_m=16, interpret=True)
    check_layout(r, tokens, 16, 2, 16)


@pytest.mark.parametrize("kw, match", [
    ({"top_k": 0}, "top_k"), ({"top_k": 9}, "top_k"), ({"block_m": 12}, "block_m"),
])
def test_argument_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        moe_route(jnp.zeros((4, 8)), **{"top_k": 2, "block_m": 16, **kw})
    with pytest.raises(ValueError, match="logits"):
        moe_route(jnp.zeros((4,)), top_k=2)


def test_route_lowers_for_cuda():
    text = lower_for_cuda(lambda lg: moe_route(lg, top_k=8, block_m=16),
                          jax.ShapeDtypeStruct((ROUTE_KERNEL_MAX_TOKENS, 128), jnp.bfloat16))
    assert "moe_route_t256_e128_k8_m16" in text
