"""The fused decode step (conv update + gates + delta rule) vs its jnp reference, and the reference vs the
general path's pieces (qwen3_5.causal_conv over one row per sequence, then the recurrent reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.qwen3_5 import causal_conv
from pallas_kernels.gated_delta_rule import recurrent_reference, token_sequences
from pallas_kernels.gated_delta_rule_decode import decode_reference, fused_decode_step, gates
from tests.kernels.conftest import MODES


def problem(rng, B, fresh, hk, hv, dk, dv, dtype, taps=4, num_slots=None, padding=0):
    """B real sequences (rows) plus `padding` padding rows on slot 0. The projection holds mixed | z | b | a
    (the model's layout: b and a after the gate's Hv Dv columns)."""
    C = 2 * hk * dk + hv * dv
    num_slots = num_slots or B + 3
    n = B + padding
    proj = jnp.asarray(rng.standard_normal((n, C + hv * dv + 2 * hv)), dtype)
    conv_state = jnp.asarray(rng.standard_normal((num_slots, taps - 1, C)), dtype)
    conv_w = jnp.asarray(rng.standard_normal((C, 1, taps)) * 0.5, dtype)
    a_log = jnp.asarray(rng.uniform(-1, 1, hv), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(hv), jnp.float32)
    states = jnp.asarray(rng.standard_normal((num_slots, hv, dk, dv)), jnp.float32)
    slots = np.concatenate([rng.permutation(np.arange(1, num_slots))[:B], np.zeros(padding, np.int64)])
    fresh = np.concatenate([np.asarray(fresh, bool), np.ones(padding, bool)])
    return (proj, conv_state, conv_w, a_log, dt_bias, states, jnp.asarray(slots, jnp.int32), jnp.asarray(fresh))


def columns(hk, hv, dk, dv):
    C = 2 * hk * dk + hv * dv
    return dict(b_col=C + hv * dv, a_col=C + hv * dv + hv)


# (B, fresh, hk, hv, dk, dv, dtype, padding rows)
CASES = [
    pytest.param(3, [0, 1, 0], 2, 4, 16, 32, jnp.float32, 1, id="f32-gqa2-pad"),
    pytest.param(2, [0, 0], 1, 1, 32, 16, jnp.float32, 0, id="f32-mha"),
    pytest.param(4, [1, 0, 0, 0], 2, 8, 32, 64, jnp.bfloat16, 4, id="bf16-gqa4-pad"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B,fresh,hk,hv,dk,dv,dtype,padding", CASES)
def test_fused_decode_matches_reference(mode, B, fresh, hk, hv, dk, dv, dtype, padding):
    rng = np.random.default_rng(B * 7 + dk + hv)
    args = problem(rng, B, fresh, hk, hv, dk, dv, dtype, padding=padding)
    dims = dict(num_k_heads=hk, key_dim=dk, value_dim=dv, **columns(hk, hv, dk, dv))
    slots = np.asarray(args[6])[:B]
    untouched = np.setdiff1d(np.arange(args[1].shape[0]), np.asarray(args[6]))
    conv_before, states_before = np.asarray(args[1])[untouched], np.asarray(args[5])[untouched]
    o_ref, conv_ref, s_ref = decode_reference(*args, **dims)
    o, conv, s = fused_decode_step(*args, **dims, block_v=16, interpret=mode == "interpret")
    tol = 2e-2 if dtype == jnp.bfloat16 else (1e-2 if mode == "gpu" else 2e-5)
    assert o.dtype == dtype
    np.testing.assert_allclose(np.asarray(o.astype(jnp.float32))[:B], np.asarray(o_ref.astype(jnp.float32))[:B],
                               atol=tol, rtol=tol)
    np.testing.assert_allclose(np.asarray(s)[slots], np.asarray(s_ref)[slots], atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.asarray(conv.astype(jnp.float32))[slots],
                                  np.asarray(conv_ref.astype(jnp.float32))[slots])  # a copy: exact
    np.testing.assert_array_equal(np.asarray(conv)[untouched], conv_before)  # other slots are left alone
    np.testing.assert_array_equal(np.asarray(s)[untouched], states_before)


def test_decode_reference_is_the_general_path_on_one_row_per_sequence():
    """The general path: causal_conv over a ragged batch of one-row sequences, split, gates, recurrent rule."""
    rng = np.random.default_rng(5)
    hk, hv, dk, dv, B = 2, 4, 16, 16, 3
    proj, conv_state, conv_w, a_log, dt_bias, states, slots, fresh = problem(
        rng, B, [0, 1, 0], hk, hv, dk, dv, jnp.float32)
    cols = columns(hk, hv, dk, dv)
    o_ref, conv_ref, s_ref = decode_reference(proj, conv_state, conv_w, a_log, dt_bias, states, slots, fresh,
                                              num_k_heads=hk, key_dim=dk, value_dim=dv, **cols)
    C = conv_w.shape[0]
    mixed, b, a = proj[:, :C], proj[:, cols["b_col"]:cols["b_col"] + hv], proj[:, cols["a_col"]:cols["a_col"] + hv]
    qs = jnp.arange(B + 1, dtype=jnp.int32)
    y, conv = causal_conv(mixed, conv_state, conv_w, token_sequences(qs, B), qs[:-1], qs, slots, fresh)
    q, k, v = jnp.split(y, [hk * dk, 2 * hk * dk], axis=-1)
    beta, g = gates(b, a, a_log, dt_bias)
    o, s = recurrent_reference(q.reshape(B, hk, dk), k.reshape(B, hk, dk), v.reshape(B, hv, dv), g, beta, states,
                               slots, fresh, qs)
    np.testing.assert_allclose(np.asarray(o_ref), np.asarray(o), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s_ref), np.asarray(s), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(conv_ref), np.asarray(conv))


def test_fused_decode_argument_checks():
    rng = np.random.default_rng(0)
    args = list(problem(rng, 2, [0, 0], 2, 4, 16, 16, jnp.float32))
    cols = columns(2, 4, 16, 16)
    with pytest.raises(ValueError, match="2 Hk Dk"):
        fused_decode_step(*args, num_k_heads=1, key_dim=16, value_dim=16, **cols, interpret=True)
    with pytest.raises(ValueError, match="columns"):
        fused_decode_step(*args, num_k_heads=2, key_dim=16, value_dim=16, b_col=3, a_col=cols["a_col"],
                          interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        fused_decode_step(*args, num_k_heads=2, key_dim=16, value_dim=16, **cols, block_v=8, interpret=True)
    jax.block_until_ready(args)
