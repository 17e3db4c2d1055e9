"""The fused intra-chunk kernel against its jnp reference `intra_chunk` (every output, the chunks that hold
rows): ragged layouts (a 1-row sequence, a last chunk of 6 rows, chunks that end at T), GQA, float32 and bf16
activations, both ways of inverting the diagonal blocks; strong decays and near-parallel keys; the Triton
lowering at Qwen3.5-4B's shapes. End to end (with the recurrence) it is tested against the token-by-token
reference in test_gated_delta_rule_chunked.py."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.linear_attention.gated_delta_rule_chunked import CHUNK, chunk_layout, max_chunks
from pallas_kernels.linear_attention.gated_delta_rule_intra import OUTPUTS, intra_chunk, intra_chunk_pallas
from tests.kernels.conftest import MODES, by_mode
from tests.kernels.test_gated_delta_rule import problem


def layout_rows(lens, T, min_len=1):
    qs = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    lay = chunk_layout(qs, T, max_chunks(T, len(lens), CHUNK, min_len), CHUNK, min_len)
    return lay["rows"], int(lay["chunk_start"][-1])


def assert_parts_match(got, want, used, tol):
    """Each output of the used chunks within tol of the reference's largest entry (the others: undefined)."""
    for name in OUTPUTS:
        a = np.asarray(got[name][:used].astype(jnp.float32))
        b = np.asarray(want[name][:used])
        assert np.isfinite(a).all(), name
        np.testing.assert_allclose(a, b, atol=tol * max(np.abs(b).max(), 1e-3), rtol=0, err_msg=name)


# (lens, hk, hv, dk, dv, dtype, padded T)
CASES = [
    pytest.param([1, 70, 128], 2, 4, 16, 32, jnp.float32, 199, id="ragged-f32-gqa2"),
    pytest.param([90, 0], 1, 2, 32, 16, jnp.bfloat16, 96, id="bf16-padded"),
]


GPU_CASES = [pytest.param(di, 1, *c.values, id=f"{di}-{c.id}") for di in ["products", "substitution"] for c in CASES]
# The interpreter (one compile per case) takes each way of inverting once, and two value heads of a key head per
# program (the key-side work shared; test_intra_kernel_heads_per_program on the GPU) on the GQA case.
INTERPRET_CASES = [pytest.param("products", 2, *CASES[0].values, id=f"products-hpp2-{CASES[0].id}"),
                   pytest.param("substitution", 1, *CASES[1].values, id=f"substitution-{CASES[1].id}")]


@pytest.mark.parametrize("mode,diag_inverse,heads,lens,hk,hv,dk,dv,dtype,T", by_mode(INTERPRET_CASES, GPU_CASES))
def test_intra_kernel_matches_jnp(mode, diag_inverse, heads, lens, hk, hv, dk, dv, dtype, T):
    q, k, v, g, beta = problem(np.random.default_rng(len(lens) + T), lens, [1] * len(lens), hk, hv, dk, dv, dtype,
                               T)[:5]
    rows, used = layout_rows(lens, T)
    want = intra_chunk(q, k, v, g, beta, rows)
    got = intra_chunk_pallas(q, k, v, g, beta, rows, exact=True, diag_inverse=diag_inverse, heads_per_program=heads,
                             interpret=mode == "interpret")
    assert got["w"].dtype == dtype and got["dl"].dtype == jnp.float32  # stored in the activations' dtype
    tol = 1e-2 if dtype == jnp.bfloat16 else (1e-5 if mode == "interpret" else 1e-3)
    assert_parts_match(got, want, used, tol)


@pytest.mark.parametrize("mode", [m for m in MODES if m.id == "gpu"])
@pytest.mark.parametrize("heads", [2, 4])
def test_intra_kernel_heads_per_program(mode, heads):
    """Several value heads of one key head per program (the key-side work shared): the same parts as one head
    per program, exactly (the same float32 operations), and as the reference. (Interpreter: the products-hpp2 case
    of test_intra_kernel_matches_jnp; heads_per_program=3 refused: test_intra_argument_checks.)"""
    lens, hk, hv, dk, dv, T = [70, 9], 2, 8, 16, 32, 80
    q, k, v, g, beta = problem(np.random.default_rng(9), lens, [1, 1], hk, hv, dk, dv, jnp.float32, T)[:5]
    rows, used = layout_rows(lens, T)
    run = partial(intra_chunk_pallas, q, k, v, g, beta, rows, exact=True, interpret=mode == "interpret")
    one, got = run(), run(heads_per_program=heads)
    for x in OUTPUTS:
        np.testing.assert_allclose(np.asarray(got[x])[:used], np.asarray(one[x])[:used], rtol=1e-6, atol=1e-6)
    assert_parts_match(got, intra_chunk(q, k, v, g, beta, rows), used, 1e-5 if mode == "interpret" else 1e-3)
    with pytest.raises(ValueError, match="heads_per_program"):
        run(heads_per_program=3)


@pytest.mark.parametrize("mode", MODES)
def test_intra_kernel_hard_cases(mode):
    """Decays up to e^-40 per row (every exponent stays <= 0: nothing overflows) and, separately, correlated keys
    with beta near 1 and almost no decay (L's entries near 1: (I + L)^-1 has huge entries that cancel). (The shapes
    and arguments of the products-hpp2 case of test_intra_kernel_matches_jnp: its compile is reused.)"""
    lens, T = [1, 70, 128], 199
    q, k, v, g, beta = problem(np.random.default_rng(7), lens, [1] * 3, 2, 4, 16, 32, jnp.float32, T)[:5]
    rows, used = layout_rows(lens, T)
    run = partial(intra_chunk_pallas, exact=True, diag_inverse="products", heads_per_program=2,
                  interpret=mode == "interpret")
    tol = 1e-5 if mode == "interpret" else 1e-3
    strong = g * 20
    # |gc| reaches ~2500 within a chunk: the reference's exp(gc_last - gc) from differences of its cumsum is off
    # by up to 2500 * 6e-8 in the exponent (the kernel sums the rows after each row as such)
    assert_parts_match(run(q, k, v, strong, beta, rows), intra_chunk(q, k, v, strong, beta, rows), used,
                       max(tol, 2e-4))
    k_par = k + 1.0  # [T, Hk, Dk]: keys leaning towards (1, ..., 1)
    args = (q, k_par, v, g * 0.01, 0.9 + beta * 0.1)
    # against XLA's triangular solve: the reference's product-form inverse (64 x 64: sums of powers of L up to
    # L^63) loses everything here (errors ~500x W's size, against a float64 solve); the kernel's 16 x 16 blocks
    # stay within 5e-6 of it
    assert_parts_match(run(*args, rows), intra_chunk(*args, rows, solve="trsm"), used,
                       2e-5 if mode == "interpret" else 1e-3)


def test_intra_kernel_breaks_when_the_solve_does():
    """The comparison can fail: a kernel given the wrong chunk rows (shifted by one) does not match. (The shapes
    and arguments of the products-hpp2 case of test_intra_kernel_matches_jnp: its compile is reused.)"""
    lens, T = [1, 70, 128], 199
    q, k, v, g, beta = problem(np.random.default_rng(1), lens, [1] * 3, 2, 4, 16, 32, jnp.float32, T)[:5]
    rows, used = layout_rows(lens, T)
    got = intra_chunk_pallas(q, k, v, g, beta, jnp.where(rows < T, jnp.minimum(rows + 1, T - 1), T), exact=True,
                             diag_inverse="products", heads_per_program=2, interpret=True)
    with pytest.raises(AssertionError):
        assert_parts_match(got, intra_chunk(q, k, v, g, beta, rows), used, 1e-2)


def test_intra_argument_checks():
    q, k, v, g, beta = problem(np.random.default_rng(0), [40], [1], 1, 2, 16, 16, jnp.float32)[:5]
    rows = jnp.arange(40, dtype=jnp.int32)[None, :]
    with pytest.raises(ValueError, match="multiple of 16"):
        intra_chunk_pallas(q, k, v, g, beta, rows, interpret=True)
    with pytest.raises(ValueError, match="diag_inverse"):
        intra_chunk_pallas(q, k, v, g, beta, rows[:, :32], diag_inverse="lu", interpret=True)
    with pytest.raises(ValueError, match="heads_per_program"):  # 2 value heads per key head
        intra_chunk_pallas(q, k, v, g, beta, rows[:, :32], heads_per_program=3, interpret=True)
    q8, k8 = q[..., :8], k[..., :8]
    with pytest.raises(ValueError, match=">= 16"):
        intra_chunk_pallas(q8, k8, v, g, beta, rows[:, :32], interpret=True)


@pytest.mark.parametrize("diag_inverse,heads", [("products", 1), ("substitution", 1), ("products", 2)])
def test_intra_kernel_lowers_for_cuda(diag_inverse, heads):
    """The Triton lowering at Qwen3.5-4B's shapes (bf16 activations, 16 q/k heads, 32 value heads, 128 x 128)
    runs without a GPU: catches what the interpreter accepts but Triton does not (16-row dots, the masked
    loads, the scalar store, reductions along either axis)."""
    from tests.kernels.conftest import lower_for_cuda

    T, NC = 256, 6
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((T, 16, 128), jnp.bfloat16), ((T, 16, 128), jnp.bfloat16), ((T, 32, 128), jnp.bfloat16),
        ((T, 32), jnp.float32), ((T, 32), jnp.float32), ((NC, CHUNK), jnp.int32)]]
    text = lower_for_cuda(partial(intra_chunk_pallas, diag_inverse=diag_inverse, heads_per_program=heads), *shapes)
    assert f"gated_delta_rule_intra_c{CHUNK}" in text
