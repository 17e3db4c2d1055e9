"""The fused decode step (conv update + gates + delta rule + gated norm) vs its jnp reference, the reference vs the
general path's pieces (causal_conv_reference over one row per sequence, the recurrent reference, the gated norm),
and the conv ring carried across chunks and decode steps vs one conv over the whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention.causal_conv import causal_conv_reference
from pallas_kernels.linear_attention.gated_delta_rule_common import recurrent_reference, token_sequences
from pallas_kernels.linear_attention.gated_delta_rule_decode import (
    conv_step,
    decode_reference,
    fused_decode_step,
    gates,
)
from pallas_kernels.linear_attention.gated_rms_norm import gated_rms_norm_reference
from tests.kernels.conftest import by_mode


def problem(rng, B, fresh, hk, hv, dk, dv, dtype, taps=4, num_slots=None, padding=0):
    """B real sequences (rows) plus `padding` padding rows on slot 0. The projection holds mixed | z | b | a
    (the model's layout). A fresh row is at position 0, the others at positions 1..9 (some before the conv's
    reach: the ring's older rows must then read as zeros); padding rows at 0."""
    C = 2 * hk * dk + hv * dv
    num_slots = num_slots or B + 3
    n = B + padding
    proj = jnp.asarray(rng.standard_normal((n, C + hv * dv + 2 * hv)), dtype)
    conv_state = jnp.asarray(rng.standard_normal((num_slots, taps, C)), dtype)
    conv_w = jnp.asarray(rng.standard_normal((C, 1, taps)) * 0.5, dtype)
    a_log = jnp.asarray(rng.uniform(-1, 1, hv), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(hv), jnp.float32)
    states = jnp.asarray(rng.standard_normal((num_slots, hv, dk, dv)), jnp.float32)
    slots = np.concatenate([rng.permutation(np.arange(1, num_slots))[:B], np.zeros(padding, np.int64)])
    fresh = np.concatenate([np.asarray(fresh, bool), np.ones(padding, bool)])
    positions = np.where(fresh, 0, rng.integers(1, 10, n))
    return (proj, conv_state, conv_w, a_log, dt_bias, states, jnp.asarray(slots, jnp.int32),
            jnp.asarray(positions, jnp.int32), jnp.asarray(fresh))


def columns(hk, hv, dk, dv):
    C = 2 * hk * dk + hv * dv
    return dict(b_col=C + hv * dv, a_col=C + hv * dv + hv)


def norm_args(rng, hk, hv, dk, dv, dtype):
    return dict(z_col=2 * hk * dk + hv * dv, norm_weight=jnp.asarray(rng.standard_normal(dv), dtype), eps=1e-6)


# (B, fresh, hk, hv, dk, dv, dtype, padding rows, gated norm)
CASES = [
    pytest.param(3, [0, 1, 0], 2, 4, 16, 32, jnp.float32, 1, True, id="f32-gqa2-pad-norm"),
    pytest.param(2, [0, 0], 1, 1, 32, 16, jnp.float32, 0, False, id="f32-mha"),
    pytest.param(4, [1, 0, 0, 0], 2, 8, 32, 64, jnp.bfloat16, 4, True, id="bf16-gqa4-pad-norm"),
]


BLOCKS = [(None, "block_v-default"), ("whole", "block_v-whole"), (16, "block_v-16")]
GPU_CASES = [pytest.param(bv, *c.values, id=f"{bid}-{c.id}") for c in CASES for bv, bid in BLOCKS]
# The interpreter (one compile per case) takes each block count once (at these small dims the default block is the
# whole head, Dv <= 128 * 128 / Dk): two blocks of 16 (f32, GQA 2, padding rows, gated norm); the default, one block
# (f32, one head each, no norm); four blocks of 16, each block's load inside the loop (bf16, GQA 4, padding rows,
# gated norm).
INTERPRET_CASES = [pytest.param(bv, *CASES[i].values, id=f"{bid}-{CASES[i].id}")
                   for i, (bv, bid) in enumerate([BLOCKS[2], BLOCKS[0], BLOCKS[2]])]


@pytest.mark.parametrize("mode,block_v,B,fresh,hk,hv,dk,dv,dtype,padding,norm", by_mode(INTERPRET_CASES, GPU_CASES))
def test_fused_decode_matches_reference(mode, block_v, B, fresh, hk, hv, dk, dv, dtype, padding, norm):
    """Every block size: one block (the whole head), the default two, and 16 columns (up to four blocks, each
    block's load issued inside the loop over blocks)."""
    rng = np.random.default_rng(B * 7 + dk + hv)
    args = problem(rng, B, fresh, hk, hv, dk, dv, dtype, padding=padding)
    dims = dict(num_k_heads=hk, key_dim=dk, value_dim=dv, **columns(hk, hv, dk, dv),
                **(norm_args(rng, hk, hv, dk, dv, dtype) if norm else {}))
    slots = np.asarray(args[6])[:B]
    untouched = np.setdiff1d(np.arange(args[1].shape[0]), np.asarray(args[6]))
    conv_before, states_before = np.asarray(args[1])[untouched], np.asarray(args[5])[untouched]
    o_ref, conv_ref, s_ref = decode_reference(*args, **dims)
    o, conv, s = fused_decode_step(*args, **dims, block_v=dv if block_v == "whole" else block_v,
                                   interpret=mode == "interpret")
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
    """The general path: causal_conv_reference over a ragged batch of one-row sequences, split, gates, recurrent rule,
    gated norm."""
    rng = np.random.default_rng(5)
    hk, hv, dk, dv, B = 2, 4, 16, 16, 3
    proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions, fresh = problem(
        rng, B, [0, 1, 0], hk, hv, dk, dv, jnp.float32)
    cols, nargs = columns(hk, hv, dk, dv), norm_args(rng, hk, hv, dk, dv, jnp.float32)
    o_ref, conv_ref, s_ref = decode_reference(proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions,
                                              fresh, num_k_heads=hk, key_dim=dk, value_dim=dv, **cols, **nargs)
    C = conv_w.shape[0]
    mixed, b, a = proj[:, :C], proj[:, cols["b_col"]:cols["b_col"] + hv], proj[:, cols["a_col"]:cols["a_col"] + hv]
    z = proj[:, nargs["z_col"]:nargs["z_col"] + hv * dv].reshape(B, hv, dv)
    qs = jnp.arange(B + 1, dtype=jnp.int32)
    y, conv = causal_conv_reference(mixed, conv_state, conv_w, token_sequences(qs, B), qs[:-1], qs, slots, positions)
    q, k, v = jnp.split(y, [hk * dk, 2 * hk * dk], axis=-1)
    beta, g = gates(b, a, a_log, dt_bias)
    o, s = recurrent_reference(q.reshape(B, hk, dk), k.reshape(B, hk, dk), v.reshape(B, hv, dv), g, beta, states,
                               slots, fresh, qs)
    o = gated_rms_norm_reference(o.astype(proj.dtype), z, nargs["norm_weight"], nargs["eps"])
    np.testing.assert_allclose(np.asarray(o_ref), np.asarray(o), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s_ref), np.asarray(s), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(conv_ref), np.asarray(conv))


@pytest.mark.parametrize("chunks", [[11], [3, 1, 5, 1, 1], [1, 1, 1, 1, 7], [2, 9]])
def test_conv_ring_across_chunks_and_decode_steps(chunks):
    """Two sequences fed in chunks (ragged steps through causal_conv_reference; a one-row step of both through the
    decode reference's conv) give the conv of each whole sequence from zeros, whatever the slots held before."""
    rng = np.random.default_rng(len(chunks))
    C, K, L = 8, 4, sum(chunks)
    x = [jnp.asarray(rng.standard_normal((L, C)), jnp.float32) for _ in range(2)]
    w = jnp.asarray(rng.standard_normal((C, 1, K)), jnp.float32)
    conv_state = jnp.asarray(rng.standard_normal((4, K, C)), jnp.float32)  # stale rings: must never be read
    slots = jnp.asarray([2, 3], jnp.int32)
    whole = []
    for xs in x:
        qs = jnp.asarray([0, L], jnp.int32)
        y, _ = causal_conv_reference(xs, conv_state, w, jnp.zeros(L, jnp.int32), qs[:-1], qs, slots[:1], jnp.arange(L))
        whole.append(y)
    # a causal conv + SiLU from zeros, computed directly
    for xs, y in zip(x, whole, strict=True):
        padded = np.concatenate([np.zeros((K - 1, C)), np.asarray(xs)])
        direct = sum(padded[K - 1 - d:K - 1 - d + L] * np.asarray(w)[:, 0, K - 1 - d] for d in range(K))
        np.testing.assert_allclose(np.asarray(y), direct / (1 + np.exp(-direct)), atol=1e-5, rtol=1e-5)
    got, start = [[], []], 0
    for n in chunks:
        if n == 1:  # both sequences' next row: a decode step (decode_reference's conv)
            positions = jnp.asarray([start, start], jnp.int32)
            mixed = jnp.stack([x[0][start], x[1][start]])
            y, conv_state = conv_step(mixed, conv_state, w, slots, positions)
            got[0].append(y[:1])
            got[1].append(y[1:])
        else:  # a ragged step: sequence 0's n rows, then sequence 1's
            rows = jnp.concatenate([x[0][start:start + n], x[1][start:start + n]])
            qs = jnp.asarray([0, n, 2 * n], jnp.int32)
            seq = jnp.repeat(jnp.arange(2, dtype=jnp.int32), n)
            positions = jnp.tile(jnp.arange(start, start + n, dtype=jnp.int32), 2)
            y, conv_state = causal_conv_reference(rows, conv_state, w, seq, qs[:-1], qs, slots, positions)
            got[0].append(y[:n])
            got[1].append(y[n:])
        start += n
    for b in range(2):
        np.testing.assert_allclose(np.asarray(jnp.concatenate(got[b])), np.asarray(whole[b]), atol=1e-5, rtol=1e-5)


def test_fused_decode_argument_checks():
    rng = np.random.default_rng(0)
    args = list(problem(rng, 2, [0, 0], 2, 4, 16, 16, jnp.float32))
    cols = columns(2, 4, 16, 16)
    with pytest.raises(ValueError, match="2 Hk Dk"):
        fused_decode_step(*args, num_k_heads=1, key_dim=16, value_dim=16, **cols, interpret=True)
    with pytest.raises(ValueError, match="columns"):
        fused_decode_step(*args, num_k_heads=2, key_dim=16, value_dim=16, b_col=3, a_col=cols["a_col"],
                          interpret=True)
    with pytest.raises(ValueError, match="gated norm"):
        fused_decode_step(*args, num_k_heads=2, key_dim=16, value_dim=16, **cols, z_col=cols["b_col"] - 64,
                          interpret=True)
    with pytest.raises(ValueError, match="gated norm"):
        fused_decode_step(*args, num_k_heads=2, key_dim=16, value_dim=16, **cols, z_col=cols["b_col"] - 64,
                          norm_weight=jnp.ones(8), interpret=True)
    with pytest.raises(ValueError, match="block_v"):
        fused_decode_step(*args, num_k_heads=2, key_dim=16, value_dim=16, **cols, block_v=8, interpret=True)
    stale = args[1][:, :3]  # a window of K - 1 rows (the layout before the ring): refused
    with pytest.raises(ValueError, match="conv_state"):
        fused_decode_step(args[0], stale, *args[2:], num_k_heads=2, key_dim=16, value_dim=16, **cols, interpret=True)
    jax.block_until_ready(args)
