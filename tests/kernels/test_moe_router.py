"""moe_norm_router (one Pallas kernel: RMSNorm + router projection) vs XLA's norm and dot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_router import MAX_TOKENS, moe_norm_router, moe_norm_router_reference
from tests.kernels.conftest import MODES, lower_for_cuda

CASES = [  # tokens, hidden, experts, dtype
    pytest.param(1, 2048, 128, jnp.bfloat16, id="qwen3-30b-a3b-b1"),
    pytest.param(16, 2048, 128, jnp.bfloat16, id="qwen3-30b-a3b-b16"),
    pytest.param(37, 256, 64, jnp.bfloat16, id="t37"),
    pytest.param(5, 256, 24, jnp.bfloat16, id="e24-block-e8"),
    pytest.param(MAX_TOKENS, 64, 8, jnp.float32, id="f32-max-tokens"),
    pytest.param(3, 48, 24, jnp.float32, id="f32-not-pow2"),
]


def inputs(tokens, hidden, experts, dtype):
    kx, kn, kw = jax.random.split(jax.random.key(tokens * hidden + experts), 3)
    x = (3 * jax.random.normal(kx, (tokens, hidden))).astype(dtype)
    norm = (1 + 0.1 * jax.random.normal(kn, (hidden,))).astype(dtype)
    router = (jax.random.normal(kw, (hidden, experts)) / np.sqrt(hidden)).astype(dtype)
    return x, norm, router


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,hidden,experts,dtype", CASES)
def test_matches_xla(mode, tokens, hidden, experts, dtype):
    x, norm, router = inputs(tokens, hidden, experts, dtype)
    h, logits = moe_norm_router(x, norm, router, eps=1e-6, interpret=mode == "interpret")
    h_ref, logits_ref = moe_norm_router_reference(x, norm, router, eps=1e-6)
    assert h.dtype == dtype and h.shape == x.shape and logits.dtype == jnp.float32
    assert logits.shape == (tokens, experts)
    # h takes the same rounding steps, but the row's sum of squares runs in another order: a value may land
    # one ulp apart (2^-8 relative in bf16); so may the logits, summed in another order and then rounded
    ulp = 2.0 ** -8 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(np.asarray(h.astype(jnp.float32)), np.asarray(h_ref.astype(jnp.float32)), rtol=ulp)
    tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_ref), rtol=tol, atol=tol)
    assert np.array_equal(np.asarray(logits), np.asarray(logits.astype(dtype).astype(jnp.float32))), \
        "logits are not values of x's dtype"


@pytest.mark.parametrize("block_e,block_k", [(8, 16), (32, 512)])
def test_tilings_agree(block_e, block_k):
    x, norm, router = inputs(5, 1024, 64, jnp.bfloat16)
    h, logits = moe_norm_router(x, norm, router, eps=1e-6, block_e=block_e, block_k=block_k, interpret=True)
    h0, logits0 = moe_norm_router(x, norm, router, eps=1e-6, interpret=True)
    np.testing.assert_array_equal(np.asarray(h.astype(jnp.float32)), np.asarray(h0.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits0), rtol=1e-2, atol=1e-2)


def test_bad_arguments_are_value_errors():
    x, norm, router = inputs(2, 64, 8, jnp.float32)
    with pytest.raises(ValueError, match="tokens"):
        moe_norm_router(jnp.zeros((MAX_TOKENS + 1, 64)), norm, router, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="router"):
        moe_norm_router(x, norm, router.T, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="block_e"):
        moe_norm_router(x, norm, router, eps=1e-6, block_e=3, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        moe_norm_router(x, norm.astype(jnp.bfloat16), router, eps=1e-6, interpret=True)


def test_lowers_for_the_gpu():
    """The Triton lowering takes the kernel (CPU: lowered for an abstract H100, not compiled)."""
    text = lower_for_cuda(lambda x, n, w: moe_norm_router(x, n, w, eps=1e-6),
                          jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16),
                          jax.ShapeDtypeStruct((2048, 128), jnp.bfloat16))
    assert "moe_norm_router_t16_e16_k256" in text
