"""skinny_gemm vs its jnp reference (XLA's own dot)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense.skinny_gemm import default_config, skinny_gemm, skinny_gemm_reference, skinny_gemm_residual
from tests.kernels.conftest import MODES, assert_close

# (tokens, K, N, dtype, launch overrides)
CASES = [
    pytest.param(1, 256, 128, jnp.float32, {}, id="t1-f32"),
    pytest.param(5, 512, 192, jnp.bfloat16, {"block_n": 64, "k_splits": 2, "block_k": 64}, id="t5-bf16-split2"),
    pytest.param(17, 256, 256, jnp.bfloat16, {"block_n": 128, "k_splits": 4, "block_k": 32}, id="t17-bf16-split4"),
    pytest.param(32, 128, 64, jnp.float32, {"block_n": 32}, id="t32-f32"),
    pytest.param(1, 16, 48, jnp.float32, {}, id="t1-k16-n48-defaults"),  # tiles shrink to the dims (16)
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,k,n,dtype,kw", CASES)
def test_skinny_gemm_matches_reference(mode, tokens, k, n, dtype, kw):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
    out = skinny_gemm(x, w, interpret=mode == "interpret", **kw)
    assert out.shape == (tokens, n) and out.dtype == jnp.float32
    assert_close(out, skinny_gemm_reference(x, w), dtype, mode)


def test_default_config_fills_the_gpu_and_divides():
    for k, n in [(2560, 6144), (4096, 2560), (9728, 2560), (2560, 151936), (128, 64)]:
        c = default_config(k, n)
        assert n % c["block_n"] == 0 and k % (c["k_splits"] * c["block_k"]) == 0
    assert default_config(4096, 2560)["k_splits"] > 1  # 40 column blocks alone would leave SMs idle


def test_skinny_gemm_argument_checks():
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="tokens"):
        skinny_gemm(jnp.zeros((33, 64)), jnp.zeros((64, 64)), interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        skinny_gemm(x, jnp.zeros((64, 96)), block_n=64, interpret=True)
    with pytest.raises(ValueError, match="k_splits"):
        skinny_gemm(x, jnp.zeros((64, 64)), k_splits=4, block_k=32, interpret=True)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        skinny_gemm(x, jnp.zeros((32, 64)), interpret=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,kw", [(1, {"block_n": 64, "k_splits": 4, "block_k": 32}), (9, {}),
                                       (3, {"k_splits": 1})])
def test_skinny_gemm_residual_tail(mode, tokens, kw):
    """residual + x @ w with the split sum and the add in the kernel; the counters come back zero, so a second
    call on them gives the same result."""
    rng = np.random.default_rng(tokens)
    k, n, dtype = 512, 192, jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
    r = jnp.asarray(rng.standard_normal((tokens, n)) * 3, dtype)
    want = r + skinny_gemm_reference(x, w).astype(dtype)
    counters = jnp.zeros((16,), jnp.int32)
    for _ in range(2):
        out, counters = skinny_gemm_residual(x, w, r, counters, interpret=mode == "interpret", **kw)
        assert out.shape == (tokens, n) and out.dtype == dtype
        assert_close(out, want, dtype, mode)
        np.testing.assert_array_equal(np.asarray(counters), 0)


def test_skinny_gemm_residual_checks():
    x, w = jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((64, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="residual"):
        skinny_gemm_residual(x, w, jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((8,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="counters"):
        skinny_gemm_residual(x, w, jnp.zeros((2, 128), jnp.bfloat16), jnp.zeros((1,), jnp.int32), block_n=32,
                             interpret=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,kw", [(1, {"block_n": 32, "block_k": 64}), (8, {"block_n": 16}), (32, {})])
def test_gemv_residual(mode, tokens, kw):
    """residual + x @ w, one split, the add in each program's epilogue."""
    from pallas_kernels.dense.skinny_gemm import gemv_residual

    rng = np.random.default_rng(tokens)
    k, n, dtype = 512, 192, jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
    r = jnp.asarray(rng.standard_normal((tokens, n)) * 3, dtype)
    out = gemv_residual(x, w, r, interpret=mode == "interpret", **kw)
    assert out.shape == (tokens, n) and out.dtype == dtype
    assert_close(out, r + skinny_gemm_reference(x, w).astype(dtype), dtype, mode)
    with pytest.raises(ValueError, match="residual"):
        gemv_residual(x, w, r[:, :64], interpret=True)
