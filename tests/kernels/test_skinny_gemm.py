"""skinny_gemm vs its jnp reference (XLA's own dot)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense.skinny_gemm import default_config, skinny_gemm, skinny_gemm_reference
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
