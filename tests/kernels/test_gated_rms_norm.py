"""gated_rms_norm vs its jnp reference (HF's RMSNormGated rounding)."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference
from tests.kernels.conftest import MODES, assert_close, lower_for_cuda


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape,dtype", [((5, 4, 16), jnp.float32), ((33, 32, 128), jnp.bfloat16)])
def test_gated_rms_norm_matches_reference(mode, shape, dtype):
    rng = np.random.default_rng(shape[0])
    x = jnp.asarray(rng.standard_normal(shape), dtype)
    z = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(shape[-1:]), dtype)
    out = gated_rms_norm(x, z, w, eps=1e-6, interpret=mode == "interpret")
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, gated_rms_norm_reference(x, z, w, 1e-6), dtype, mode)


@pytest.mark.parametrize("mode", MODES)
def test_gated_rms_norm_reads_the_gate_in_place(mode):
    """gate_col: the gates are columns [gate_col, gate_col + H D) of a wider [T, W] array (the projection)."""
    rng = np.random.default_rng(7)
    T, H, D, col = 11, 4, 32, 40
    x = jnp.asarray(rng.standard_normal((T, H, D)), jnp.float32)
    proj = jnp.asarray(rng.standard_normal((T, col + H * D + 24)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(D), jnp.float32)
    out = gated_rms_norm(x, proj, w, eps=1e-6, gate_col=col, interpret=mode == "interpret")
    z = proj[:, col:col + H * D].reshape(T, H, D)
    assert_close(out, gated_rms_norm_reference(x, z, w, 1e-6), jnp.float32, mode)
    with pytest.raises(ValueError, match="gate_col"):
        gated_rms_norm(x, proj, w, eps=1e-6, gate_col=col + 30, interpret=True)


def test_gated_rms_norm_checks_and_lowers_for_cuda():
    with pytest.raises(ValueError, match="power of two"):
        gated_rms_norm(jnp.zeros((2, 12)), jnp.zeros((2, 12)), jnp.zeros(12), eps=1e-6, interpret=True)
    s = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    text = lower_for_cuda(partial(gated_rms_norm, eps=1e-6), s, s, jax.ShapeDtypeStruct((128,), jnp.bfloat16))
    assert "gated_rms_norm" in text
