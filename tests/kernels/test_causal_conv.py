"""The ragged causal conv kernel vs its jnp reference (itself checked against a direct conv over whole sequences in
test_gated_delta_rule_decode.py and, through the model, against HF), and ModelOps.causal_conv's two backends."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.ops import ModelOps
from pallas_kernels.linear_attention.causal_conv import causal_conv, causal_conv_reference, conv_reference
from tests.kernels.conftest import by_mode


def problem(rng, lens, starts_at, C, K=4, dtype=jnp.float32, padding=0):
    """Sequences of `lens` new rows, sequence i's first new row at position starts_at[i] (0: fresh, < K - 1:
    some taps before position 0, which must read zeros whatever the ring holds), then `padding` padding rows
    (sequence B)."""
    B = len(lens)
    T = sum(lens) + padding
    qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seq = np.concatenate([np.repeat(np.arange(B), lens), np.full(padding, B)]).astype(np.int32)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts_at, lens, strict=True)]
                               + [np.zeros(padding, np.int64)]).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((T, C)), dtype)
    pool = jnp.asarray(rng.standard_normal((B + 3, K, C)), dtype)  # stale rings
    w = jnp.asarray(rng.standard_normal((C, 1, K)) * 0.5, dtype)
    slots = jnp.asarray(rng.permutation(np.arange(1, B + 3))[:B], jnp.int32)
    return x, pool, w, jnp.asarray(seq), jnp.asarray(qs[:-1]), jnp.asarray(qs), slots, jnp.asarray(positions)


# (lens, first positions, channels, dtype, padding rows, block_t, block_c)
CASES = [
    pytest.param([5, 1, 1, 9], [0, 7, 2, 1], 256, jnp.float32, 3, 8, 128, id="f32-mixed-pad"),
    pytest.param([1] * 6, [0, 1, 2, 3, 4, 40], 128, jnp.float32, 0, 4, 128, id="f32-decode"),
    pytest.param([37, 2], [100, 0], 512, jnp.bfloat16, 5, 16, 256, id="bf16-prefill-ragged-tail"),
]


# The interpreter (one compile per case) leaves out f32-decode: decode rows, first positions before the conv's
# reach (1, 2) and past a ring's wrap (7), a partial last row block: all in f32-mixed-pad.
@pytest.mark.parametrize("mode,lens,starts_at,C,dtype,padding,bt,bc",
                         by_mode([c for c in CASES if c.id != "f32-decode"], CASES))
def test_causal_conv_matches_reference(mode, lens, starts_at, C, dtype, padding, bt, bc):
    rng = np.random.default_rng(len(lens) * 31 + C)
    x, pool, w, seq, starts, qs, slots, positions = problem(rng, lens, starts_at, C, dtype=dtype, padding=padding)
    want = conv_reference(x, pool, w, seq, starts, slots, positions)
    wide = jnp.concatenate([x, jnp.full((x.shape[0], 48), jnp.nan, x.dtype)], axis=1)  # columns past C: not read
    got = causal_conv(wide, pool, w, seq, starts, slots, positions, block_t=bt, block_c=bc,
                      interpret=mode == "interpret")
    assert got.shape == want.shape and got.dtype == dtype
    n = sum(lens)  # padding rows' outputs are never read
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32))[:n], np.asarray(want.astype(jnp.float32))[:n],
                               atol=tol, rtol=tol)


def test_model_ops_causal_conv_backends_agree():
    """ModelOps.causal_conv: the Pallas backend (the kernel's y, XLA's ring update) gives the reference's y and pool."""
    rng = np.random.default_rng(3)
    args = problem(rng, [3, 1, 6], [2, 9, 0], 128)
    y_ref, pool_ref = causal_conv_reference(*args)
    x, rest = args[0], args[1:]
    wide = jnp.concatenate([x, jnp.ones((x.shape[0], 40), x.dtype)], axis=1)  # a projection: q | k | v first
    y, pool = ModelOps(backend="pallas", interpret=True).causal_conv(wide, *rest)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(pool_ref))


def test_causal_conv_argument_checks():
    rng = np.random.default_rng(0)
    x, pool, w, seq, starts, _, slots, positions = problem(rng, [2, 3], [0, 4], 192)
    with pytest.raises(ValueError, match="multiple of block_c"):
        causal_conv(x, pool, w, seq, starts, slots, positions, block_c=128, interpret=True)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv(x, pool[:, :3], w, seq, starts, slots, positions, interpret=True)
