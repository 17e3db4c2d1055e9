"""fused_swiglu_mlp vs its jnp reference (XLA's own fusion)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp, fused_swiglu_mlp_reference
from tests.kernels.conftest import MODES, assert_close, by_mode

# (tokens, hidden, intermediate, dtype, block_i, RMSNorm prologue: None / unrolled / looped)
CASES = [
    pytest.param(1, 128, 256, jnp.float32, None, None, id="t1-f32"),
    pytest.param(5, 128, 384, jnp.float32, 64, None, id="t5-f32-bi64"),
    pytest.param(40, 256, 512, jnp.bfloat16, None, None, id="t40-bf16"),
    pytest.param(70, 160, 256, jnp.bfloat16, 32, None, id="t70-bf16-hidden160-2tiles"),
]
# The interpreter (one compile per case) also runs the norm prologue on two of them (test_mlp_with_norm_prologue on
# the GPU): unrolled on t5 (f32, block_i 64), looped on t40 (bf16, the default block_i).
INTERPRET_CASES = [CASES[0], pytest.param(*CASES[1].values[:-1], True, id="t5-f32-bi64-norm-unrolled"),
                   pytest.param(*CASES[2].values[:-1], False, id="t40-bf16-norm-looped"), CASES[3]]


@pytest.mark.parametrize("mode,tokens,hidden,inter,dtype,block_i,unroll_norm", by_mode(INTERPRET_CASES, CASES))
def test_mlp_matches_reference(mode, tokens, hidden, inter, dtype, block_i, unroll_norm):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * (1 if unroll_norm is None else 4), dtype)
    wg = jnp.asarray(rng.standard_normal((hidden, inter)) * hidden**-0.5, dtype)
    wu = jnp.asarray(rng.standard_normal((hidden, inter)) * hidden**-0.5, dtype)
    wd = jnp.asarray(rng.standard_normal((inter, hidden)) * inter**-0.5, dtype)
    norm = {} if unroll_norm is None else dict(
        norm_weight=jnp.asarray(1 + 0.2 * rng.standard_normal(hidden), dtype), eps=1e-5, unroll_norm=unroll_norm)
    out = fused_swiglu_mlp(x, wg, wu, wd, norm.get("norm_weight"), eps=norm.get("eps", 1e-6),
                           unroll_norm=norm.get("unroll_norm", True), block_i=block_i, interpret=mode == "interpret")
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = fused_swiglu_mlp_reference(x, wg, wu, wd, norm.get("norm_weight"), eps=norm.get("eps", 1e-6))
    assert_close(out, ref, dtype, mode)


@pytest.mark.parametrize("mode", [m for m in MODES if m.id == "gpu"])  # interpreter: test_mlp_matches_reference
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
