"""fused_swiglu_mlp vs its jnp reference (XLA's own fusion)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp, fused_swiglu_mlp_reference
from tests.kernels.conftest import MODES, assert_close

# (tokens, hidden, intermediate, dtype, block_i)
CASES = [
    pytest.param(1, 128, 256, jnp.float32, None, id="t1-f32"),
    pytest.param(5, 128, 384, jnp.float32, 64, id="t5-f32-bi64"),
    pytest.param(40, 256, 512, jnp.bfloat16, None, id="t40-bf16"),
    pytest.param(70, 160, 256, jnp.bfloat16, 32, id="t70-bf16-hidden160-2tiles"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,hidden,inter,dtype,block_i", CASES)
def test_mlp_matches_reference(mode, tokens, hidden, inter, dtype, block_i):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), dtype)
    wg = jnp.asarray(rng.standard_normal((hidden, inter)) * hidden**-0.5, dtype)
    wu = jnp.asarray(rng.standard_normal((hidden, inter)) * hidden**-0.5, dtype)
    wd = jnp.asarray(rng.standard_normal((inter, hidden)) * inter**-0.5, dtype)
    out = fused_swiglu_mlp(x, wg, wu, wd, block_i=block_i, interpret=mode == "interpret")
    assert out.shape == x.shape and out.dtype == x.dtype
    assert_close(out, fused_swiglu_mlp_reference(x, wg, wu, wd), dtype, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("unroll_norm", [True, False])
def test_mlp_with_norm_prologue(mode, unroll_norm):
    rng = np.random.default_rng(3)
    tokens, hidden, inter, dtype = 3, 128, 256, jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 4, dtype)
    wg, wu = (jnp.asarray(rng.standard_normal((hidden, inter)) * hidden**-0.5, dtype) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((inter, hidden)) * inter**-0.5, dtype)
    g = jnp.asarray(1 + 0.2 * rng.standard_normal(hidden), dtype)
    out = fused_swiglu_mlp(x, wg, wu, wd, g, eps=1e-5, unroll_norm=unroll_norm, interpret=mode == "interpret")
    assert_close(out, fused_swiglu_mlp_reference(x, wg, wu, wd, g, eps=1e-5), dtype, mode)


def test_mlp_argument_checks():
    x = jnp.zeros((4, 64))
    w = jnp.zeros((64, 128))
    with pytest.raises(ValueError, match="w_down"):
        fused_swiglu_mlp(x, w, w, jnp.zeros((64, 128)), interpret=True)
    with pytest.raises(ValueError, match="w_gate"):
        fused_swiglu_mlp(x, jnp.zeros((32, 128)), w, jnp.zeros((128, 64)), interpret=True)
    with pytest.raises(ValueError, match="block_i"):
        fused_swiglu_mlp(x, w, w, jnp.zeros((128, 64)), block_i=48, interpret=True)
