"""The recurrent gated delta rule kernel vs its jnp reference (HF's recurrent form) on ragged batches:
decode rows, prefill runs, fresh and continued sequences, GQA, padding rows and sequences."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention.gated_delta_rule import recurrent_gated_delta_rule
from pallas_kernels.linear_attention.gated_delta_rule_common import recurrent_reference
from tests.kernels.conftest import MODES


def problem(rng, lens, fresh, hk, hv, dk, dv, dtype, T=None, num_slots=None):
    total = sum(lens)
    T = T or total
    B = len(lens)
    num_slots = num_slots or B + 3
    qs = np.zeros(B + 1, np.int32)
    qs[1:] = np.cumsum(lens)
    q = jnp.asarray(rng.standard_normal((T, hk, dk)), dtype)
    k = jnp.asarray(rng.standard_normal((T, hk, dk)), dtype)
    v = jnp.asarray(rng.standard_normal((T, hv, dv)), dtype)
    g = jnp.asarray(-rng.uniform(0.01, 2.0, (T, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (T, hv)), jnp.float32)
    states = jnp.asarray(rng.standard_normal((num_slots, hv, dk, dv)), jnp.float32)
    slots = jnp.asarray(rng.permutation(np.arange(1, num_slots))[:B], jnp.int32)
    return q, k, v, g, beta, states, slots, jnp.asarray(fresh), jnp.asarray(qs)


# (lens, fresh, hk, hv, dk, dv, dtype, padded T)
CASES = [
    pytest.param([1, 1, 1, 1], [0, 0, 1, 0], 2, 4, 16, 32, jnp.float32, 8, id="decode-f32-gqa2"),
    pytest.param([7, 1, 20, 0], [1, 0, 0, 1], 2, 2, 32, 16, jnp.float32, 32, id="ragged-f32-padseq"),
    pytest.param([3, 65], [0, 1], 1, 4, 64, 64, jnp.bfloat16, 80, id="prefill-bf16-gqa4"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lens,fresh,hk,hv,dk,dv,dtype,T", CASES)
def test_recurrent_kernel_matches_reference(mode, lens, fresh, hk, hv, dk, dv, dtype, T):
    rng = np.random.default_rng(sum(lens) + dk)
    args = problem(rng, lens, fresh, hk, hv, dk, dv, dtype, T)
    o_ref, s_ref = recurrent_reference(*args)
    untouched = np.setdiff1d(np.arange(args[5].shape[0]), np.asarray(args[6]))
    before = np.asarray(args[5])[untouched]
    o, s = recurrent_gated_delta_rule(*args, block_v=16, interpret=mode == "interpret")
    tol = 1e-2 if mode == "gpu" else 2e-5
    total = sum(lens)
    np.testing.assert_allclose(np.asarray(o)[:total], np.asarray(o_ref)[:total], atol=tol, rtol=tol)
    assert not np.asarray(o)[total:].any()  # padding rows
    np.testing.assert_allclose(np.asarray(s)[np.asarray(args[6])], np.asarray(s_ref)[np.asarray(args[6])],
                               atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(s)[untouched], before)  # other slots are left alone


def test_recurrent_kernel_argument_checks():
    rng = np.random.default_rng(0)
    args = list(problem(rng, [2], [1], 2, 3, 16, 16, jnp.float32))
    with pytest.raises(ValueError, match="multiple"):
        recurrent_gated_delta_rule(*args, interpret=True)
    args = list(problem(rng, [2], [1], 2, 4, 16, 16, jnp.float32))
    args[5] = args[5].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        recurrent_gated_delta_rule(*args, interpret=True)


def test_recurrent_kernel_lowers_for_cuda():
    """The Pallas Triton lowering runs on a machine without a GPU: catches what the interpreter accepts but
    Triton does not."""
    from functools import partial

    import jax

    from tests.kernels.conftest import lower_for_cuda

    T, B, S = 8, 8, 9
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((T, 16, 128), jnp.bfloat16), ((T, 16, 128), jnp.bfloat16), ((T, 32, 128), jnp.bfloat16),
        ((T, 32), jnp.float32), ((T, 32), jnp.float32), ((S, 32, 128, 128), jnp.float32),
        ((B,), jnp.int32), ((B,), jnp.bool_), ((B + 1,), jnp.int32)]]
    text = lower_for_cuda(partial(recurrent_gated_delta_rule, block_v=32), *shapes)
    assert "recurrent_gated_delta_rule" in text
