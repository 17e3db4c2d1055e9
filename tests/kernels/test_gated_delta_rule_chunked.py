"""The chunked (WY) gated delta rule (the intra-chunk kernel, then the recurrence kernel), its jnp reference and
the pallas dispatch (chunked for long sequences, recurrent for the rest) against the token-by-token
`recurrent_reference` (golden-checked against HF) on ragged batches: sequences of 1, 63, 64, 65 and 200 rows,
fresh and continued from their slots, GQA, padding rows and an empty padding sequence."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.ops.linear_attention import gated_delta_rule
from pallas_kernels.linear_attention.gated_delta_rule_chunked import (
    CHUNK,
    chunk_layout,
    chunked_gated_delta_rule,
    chunked_reference,
    max_chunks,
)
from pallas_kernels.linear_attention.gated_delta_rule_common import recurrent_reference
from tests.kernels.conftest import MODES, by_mode
from tests.kernels.test_gated_delta_rule import problem

GPU_ONLY = [m for m in MODES if m.id == "gpu"]

# (lens, fresh, hk, hv, dk, dv, dtype, padded T); a 0-length sequence is a padding sequence (not fresh: the
# recurrent forms write its slot back unchanged, the chunked ones do not touch it)
CASES = [
    pytest.param([1, 63, 64, 65, 200, 0], [0, 1, 0, 1, 0, 0], 2, 4, 16, 32, jnp.float32, 400, id="varlen-f32-gqa2"),
    pytest.param([130, 5], [0, 0], 1, 2, 32, 16, jnp.float32, 135, id="continued-f32-gqa2"),
    pytest.param([70, 1, 1], [1, 0, 1], 2, 2, 16, 16, jnp.bfloat16, 80, id="mixed-bf16"),
]
# In the interpreter (one compile per case): every length class (1, 63, 64, 65, 200 rows: chunk boundaries, a
# partial last chunk), fresh and continued, GQA 2, Dk < Dv, two value blocks, padding rows and a padding sequence
# in float32 (varlen-f32-gqa2); bf16 activations (the intra-chunk parts stored in bf16) on a continued multi-chunk
# sequence next to short fresh and continued ones, Dk > Dv, one value block (continued-bf16-gqa2).
INTERPRET_CASES = [
    CASES[0],
    pytest.param([130, 1, 5], [0, 0, 1], 1, 2, 32, 16, jnp.bfloat16, 140, id="continued-bf16-gqa2"),
]


def assert_matches(o, s, o_ref, s_ref, args, before, lens, tol):
    """Rows and written slots as the reference's (atol relative to the largest output); other slots as before."""
    total = sum(lens)
    o, o_ref = np.asarray(o), np.asarray(o_ref)
    np.testing.assert_allclose(o[:total], o_ref[:total], atol=tol * np.abs(o_ref).max(), rtol=tol)
    assert not o[total:].any()  # padding rows
    slots = np.asarray(args[6])
    np.testing.assert_allclose(np.asarray(s)[slots], np.asarray(s_ref)[slots], atol=tol * 10, rtol=tol)
    untouched = np.setdiff1d(np.arange(before.shape[0]), slots)
    np.testing.assert_array_equal(np.asarray(s)[untouched], before[untouched])


@pytest.mark.parametrize("lens,fresh,hk,hv,dk,dv,dtype,T", INTERPRET_CASES)
def test_chunked_reference_matches_recurrent(lens, fresh, hk, hv, dk, dv, dtype, T):
    args = problem(np.random.default_rng(sum(lens)), lens, fresh, hk, hv, dk, dv, dtype, T)
    o_ref, s_ref = recurrent_reference(*args)
    o, s = jax.jit(chunked_reference)(*args)
    assert_matches(o, s, o_ref, s_ref, args, np.asarray(args[5]), lens, 1e-4)


@pytest.mark.parametrize("mode,lens,fresh,hk,hv,dk,dv,dtype,T", by_mode(INTERPRET_CASES, CASES))
def test_chunked_kernel_matches_recurrent_reference(mode, lens, fresh, hk, hv, dk, dv, dtype, T):
    args = problem(np.random.default_rng(sum(lens) + 1), lens, fresh, hk, hv, dk, dv, dtype, T)
    o_ref, s_ref = recurrent_reference(*args)
    before = np.asarray(args[5]).copy()  # the pool is donated
    o, s = chunked_gated_delta_rule(*args, block_v=16, exact=True, interpret=mode == "interpret")
    # on the GPU the reference's own einsums may run as TF32; bf16 activations: the intra-chunk kernel stores
    # W, U, Qg, Kd, P in bf16 (as fla does; measured 3-4e-3 of the largest output, 512 rows, Dk = Dv = 128)
    tol = 1e-2 if dtype == jnp.bfloat16 or mode == "gpu" else 1e-4
    assert_matches(o, s, o_ref, s_ref, args, before, lens, tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("intra,parts_dtype", [("jnp", None), ("pallas", jnp.float32)])
def test_chunked_kernel_other_intra_paths(mode, intra, parts_dtype):
    """The recurrence fed by XLA's intra-chunk part, and by the kernel's kept in float32 (bf16 activations):
    both within float32 rounding of the token-by-token reference."""
    lens, fresh = ([70, 1, 130], [1, 0, 0]) if mode == "gpu" else ([70, 1], [1, 0])  # (interpreter: fewer chunks)
    args = problem(np.random.default_rng(11), lens, fresh, 2, 4, 16, 32, jnp.bfloat16, 208 if mode == "gpu" else 72)
    o_ref, s_ref = recurrent_reference(*args)
    before = np.asarray(args[5]).copy()
    o, s = chunked_gated_delta_rule(*args, block_v=32, exact=True, intra=intra, parts_dtype=parts_dtype,
                                    interpret=mode == "interpret")
    assert_matches(o, s, o_ref, s_ref, args, before, lens, 1e-4 if mode == "interpret" else 1e-2)


@pytest.mark.parametrize("mode", GPU_ONLY)
def test_chunked_kernel_leaves_short_sequences_alone(mode):
    """min_len = 64: the 1- and 63-row sequences get zero outputs and keep their slots as they were. (In the
    interpreter: test_pallas_dispatch_matches_reference, whose chunked call, min_len = 64, must leave the 1- and
    63-row sequences' rows and slots to the recurrent kernel.)"""
    lens, fresh = [1, 63, 64, 200], [0, 1, 1, 0]
    args = problem(np.random.default_rng(3), lens, fresh, 2, 4, 16, 32, jnp.float32, 336)
    o_ref, s_ref = recurrent_reference(*args)
    before = np.asarray(args[5]).copy()
    o, s = chunked_gated_delta_rule(*args, min_len=64, block_v=32, interpret=mode == "interpret")
    o, s, slots = np.asarray(o), np.asarray(s), np.asarray(args[6])
    assert not o[:64].any()
    np.testing.assert_array_equal(s[slots[:2]], before[slots[:2]])
    tol = 1e-4 if mode == "interpret" else 1e-2
    np.testing.assert_allclose(o[64:328], np.asarray(o_ref)[64:328], atol=tol, rtol=tol)
    np.testing.assert_allclose(s[slots[2:]], np.asarray(s_ref)[slots[2:]], atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("mode", MODES)
def test_pallas_dispatch_matches_reference(mode):
    """The model's path: long sequences chunked, decode rows and short ones recurrent, in one step; and a
    step too short for any chunk (recurrent only). In the interpreter the first step has a bf16 output (the
    model's: both kernels write their own rows of one bf16 buffer; test_pallas_dispatch_bf16_output on the GPU)."""
    interpret = mode == "interpret"
    tol = 1e-4 if interpret else 1e-2
    for lens, fresh, T in [([1, 100, 1, 63, 64], [0, 1, 0, 0, 0], 240), ([3, 1], [1, 0], 8)]:
        args = problem(np.random.default_rng(len(lens)), lens, fresh, 2, 4, 16, 32, jnp.float32, T)
        o_ref, s_ref = recurrent_reference(*args)
        before = np.asarray(args[5]).copy()
        out_dtype = jnp.bfloat16 if interpret and T > 8 else jnp.float32
        o, s = jax.jit(partial(gated_delta_rule, backend="pallas", interpret=interpret, out_dtype=out_dtype))(*args)
        assert o.dtype == out_dtype
        assert_matches(o.astype(jnp.float32), s, o_ref, s_ref, args, before, lens,
                       1e-2 if out_dtype == jnp.bfloat16 else tol)


@pytest.mark.parametrize("mode", GPU_ONLY)  # interpreter: test_pallas_dispatch_matches_reference
def test_pallas_dispatch_bf16_output(mode):
    """out_dtype=bf16 (the model's): both kernels write their own rows of one bf16 buffer (no float32 o through
    HBM); the rows as the reference's rounded to bf16, padding rows zeros."""
    interpret = mode == "interpret"
    lens, fresh = [1, 100, 1, 63, 64], [0, 1, 0, 0, 0]
    args = problem(np.random.default_rng(7), lens, fresh, 2, 4, 16, 32, jnp.float32, 240)
    o_ref, s_ref = recurrent_reference(*args)
    before = np.asarray(args[5]).copy()
    o, s = jax.jit(partial(gated_delta_rule, backend="pallas", interpret=interpret, out_dtype=jnp.bfloat16))(*args)
    assert o.dtype == jnp.bfloat16
    assert_matches(o.astype(jnp.float32), s, o_ref, s_ref, args, before, lens, 1e-2)


@pytest.mark.parametrize("mode", MODES)
def test_pallas_dispatch_packed_heads(mode):
    """q|k|v packed in one [T, 2 Hk + Hv, D] array (the model's conv output, read in place by the recurrent and
    intra-chunk kernels at head offsets): the same outputs and slots as with three arrays (GPU), as the reference
    (interpreter: one compile less); a wrong packing (k heads first) differs."""
    interpret = mode == "interpret"
    lens, fresh = [1, 100, 1, 63, 64], [0, 1, 0, 0, 0]
    args = problem(np.random.default_rng(5), lens, fresh, 2, 4, 16, 16, jnp.bfloat16, 240)
    q, k, v, rest = args[0], args[1], args[2], args[3:]
    run = jax.jit(partial(gated_delta_rule, backend="pallas", interpret=interpret, out_dtype=jnp.bfloat16),
                  static_argnames="packed_k_heads")
    before = np.asarray(args[5]).copy()
    o_p, s_p = run(jnp.concatenate([q, k, v], axis=1), None, None, *rest[:2], jnp.array(rest[2]), *rest[3:],
                   packed_k_heads=2)
    if interpret:
        o, s = recurrent_reference(*args)
        assert_matches(o_p.astype(jnp.float32), s_p, o, s, args, before, lens, 1e-2)
    else:
        o, s = run(q, k, v, *rest[:2], jnp.array(rest[2]), *rest[3:])
        np.testing.assert_array_equal(np.asarray(o_p, np.float32), np.asarray(o, np.float32))
        np.testing.assert_array_equal(np.asarray(s_p), np.asarray(s))
    o_w, _ = run(jnp.concatenate([k, q, v], axis=1), None, None, *rest[:2], jnp.array(rest[2]), *rest[3:],
                 packed_k_heads=2)
    assert not np.array_equal(np.asarray(o_w, np.float32), np.asarray(o_p, np.float32))
    with pytest.raises(ValueError, match="packed"):
        gated_delta_rule(q, k, None, *rest, backend="pallas", interpret=True, packed_k_heads=2)


def test_chunk_layout():
    qs = jnp.asarray([0, 1, 65, 195, 195], jnp.int32)  # lengths 1, 64, 130, 0
    nc = max_chunks(200, 4, CHUNK, 2)
    lay = jax.jit(chunk_layout, static_argnums=(1, 2, 3, 4))(qs, 200, nc, CHUNK, 2)
    assert nc == 3 + 4 and lay["long"].tolist() == [False, True, True, False]
    assert lay["chunk_start"].tolist() == [0, 0, 1, 4, 4]
    rows = np.asarray(lay["rows"])
    assert rows[0].tolist() == list(range(1, 65)) and rows[1].tolist() == list(range(65, 129))
    assert rows[3].tolist() == [193, 194] + [200] * 62 and (rows[4:] == 200).all()
    assert lay["row_long"].tolist() == [False] + [True] * 194 + [False] * 5
    assert lay["row_chunk"][194] == 3 and lay["row_offset"][194] == 1


def test_chunked_argument_checks():
    args = list(problem(np.random.default_rng(0), [2], [1], 2, 4, 8, 16, jnp.float32))
    with pytest.raises(ValueError, match=">= 16"):
        chunked_gated_delta_rule(*args, interpret=True)
    args = list(problem(np.random.default_rng(0), [2], [1], 2, 4, 16, 16, jnp.float32))
    with pytest.raises(ValueError, match="min_len"):
        chunked_gated_delta_rule(*args, min_len=0, interpret=True)


def test_chunked_kernel_lowers_for_cuda():
    """The Pallas Triton lowering at Qwen3.5-4B's shapes runs on a machine without a GPU: catches what the
    interpreter accepts but Triton does not (dot shapes, the transposed dot, dynamic chunk indices)."""
    from tests.kernels.conftest import lower_for_cuda

    T, B, S = 256, 4, 9
    shapes = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((T, 16, 128), jnp.bfloat16), ((T, 16, 128), jnp.bfloat16), ((T, 32, 128), jnp.bfloat16),
        ((T, 32), jnp.float32), ((T, 32), jnp.float32), ((S, 32, 128, 128), jnp.float32),
        ((B,), jnp.int32), ((B,), jnp.bool_), ((B + 1,), jnp.int32)]]
    for bv in (32, 64):
        text = lower_for_cuda(partial(chunked_gated_delta_rule, min_len=64, block_v=bv), *shapes)
        assert f"chunked_gated_delta_rule_bv{bv}" in text and "gated_delta_rule_intra_c64" in text


def test_strong_decays_stay_finite():
    """Decays up to e^-40 per row (A_log large): the cumulative log-decay over a chunk reaches -2500; every
    exponent in the chunked form is <= 0, so nothing overflows and the result is still the recurrent one. (The
    shapes and arguments of the varlen-f32-gqa2 case: its compile is reused.)"""
    lens, fresh = [150, 64, 1, 63, 65, 0], [0, 1, 0, 1, 0, 0]
    args = list(problem(np.random.default_rng(5), lens, fresh, 2, 4, 16, 32, jnp.float32, 400))
    args[3] = args[3] * 20  # g in (-40, -0.2)
    o_ref, s_ref = recurrent_reference(*args)
    before = np.asarray(args[5]).copy()
    o, s = chunked_gated_delta_rule(*args, block_v=16, exact=True, interpret=True)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()
    assert_matches(o, s, o_ref, s_ref, args, before, lens, 1e-4)


@pytest.mark.parametrize("C", [2, 16, 64])
def test_unit_lower_inverse_matches_numpy(C):
    """The product-form inverse of a unit lower-triangular matrix, entries up to 1 in size (keys that are
    close to parallel, beta near 1: the hard case), against numpy's."""
    from pallas_kernels.linear_attention.gated_delta_rule_intra import unit_lower_inverse

    rng = np.random.default_rng(C)
    a = np.tril(rng.uniform(-1, 1, (3, C, C)), -1) * rng.uniform(0, 1, (3, C, 1)) + np.eye(C)
    want = np.linalg.inv(a)
    got = np.asarray(unit_lower_inverse(jnp.asarray(a, jnp.float32)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("mode", MODES)
def test_write_slots_keep_the_state_read(mode):
    """A speculative row reads its slot and writes the other of its pair (jinfer/engine/scheduler.py): the states
    written to `write_slots` are those an in-place step leaves in `slots`, the slots read keep the state from before
    the step, the others are untouched; the reference and the Pallas dispatch (a chunked and recurrent sequences)
    alike, and the conv rings' update."""
    from pallas_kernels.linear_attention.causal_conv import ring_update

    interpret = mode == "interpret"
    tol = 1e-4 if interpret else 1e-2
    lens, fresh, T = [2, 70, 1], [0, 0, 1], 80
    args = problem(np.random.default_rng(5), lens, fresh, 2, 4, 16, 32, jnp.float32, T, num_slots=8)
    slots = np.asarray(args[6])
    writes = np.setdiff1d(np.arange(1, 8), slots)[:len(slots)].astype(np.int32)
    before = np.asarray(args[5]).copy()
    o_ref, s_ref = recurrent_reference(*args)
    for backend in ("reference", "pallas"):
        o, s = jax.jit(partial(gated_delta_rule, backend=backend, interpret=interpret))(*args, write_slots=writes)
        s = np.asarray(s)
        np.testing.assert_allclose(np.asarray(o)[:sum(lens)], np.asarray(o_ref)[:sum(lens)], atol=tol, rtol=tol)
        np.testing.assert_allclose(s[writes], np.asarray(s_ref)[slots], atol=tol * 10, rtol=tol)
        others = np.setdiff1d(np.arange(8), writes)
        np.testing.assert_array_equal(s[others], before[others])  # the slots read among them
    rng = np.random.default_rng(6)
    K, C = 4, 8
    pool = jnp.asarray(rng.standard_normal((8, K, C)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((T, C)), jnp.float32)
    qs, positions = args[8], jnp.asarray(np.concatenate([np.arange(n) + 5 for n in lens] + [np.zeros(T - 73)]),
                                         jnp.int32)
    in_place = np.asarray(ring_update(x, pool, args[6], qs, positions))
    moved = np.asarray(ring_update(x, pool, args[6], qs, positions, jnp.asarray(writes)))
    np.testing.assert_array_equal(moved[writes], in_place[slots])
    np.testing.assert_array_equal(moved[np.setdiff1d(np.arange(8), writes)],
                                  np.asarray(pool)[np.setdiff1d(np.arange(8), writes)])


@pytest.mark.parametrize("mode", MODES)
def test_keep_leaves_the_state_after_the_known_rows_in_the_slot_read(mode):
    """A row verifying drafts also leaves in the slot it reads the state after its known tokens (`keep` rows: the
    scheduler goes on from there after a rejection): those slots hold what an in-place step over only those rows
    leaves, the written slots what the whole row leaves, slots of sequences keeping none are as before; the reference
    and the Pallas dispatch alike (the 70-row sequence keeping rows runs on the recurrent kernel), and the rings."""
    from pallas_kernels.linear_attention.causal_conv import ring_update

    interpret = mode == "interpret"
    tol = 1e-4 if interpret else 1e-2
    lens, fresh, keep, T = [2, 70, 1, 3], [0, 0, 1, 0], [1, 3, 0, 0], 80
    args = problem(np.random.default_rng(7), lens, fresh, 2, 4, 16, 32, jnp.float32, T, num_slots=10)
    slots, qs = np.asarray(args[6]), np.asarray(args[8])
    writes = np.setdiff1d(np.arange(1, 10), slots)[:len(slots)].astype(np.int32)
    kept = slots[np.asarray(keep) > 0]
    rows = np.concatenate([np.arange(qs[b], qs[b] + n) for b, n in enumerate(keep)])  # the known rows
    cut = [jnp.asarray(np.asarray(a)[np.pad(rows, (0, T - len(rows)))]) for a in args[:5]]
    cut_qs = jnp.asarray(np.concatenate([[0], np.cumsum(keep)] + [[sum(keep)]] * (len(qs) - len(keep) - 1)), jnp.int32)
    before = np.asarray(args[5]).copy()
    o_ref, s_ref = recurrent_reference(*args)
    _, s_cut = recurrent_reference(*cut, *args[5:8], cut_qs)
    for backend in ("reference", "pallas"):
        o, s = jax.jit(partial(gated_delta_rule, backend=backend, interpret=interpret))(
            *args, write_slots=writes, keep=jnp.asarray(keep, jnp.int32))
        s = np.asarray(s)
        np.testing.assert_allclose(np.asarray(o)[:sum(lens)], np.asarray(o_ref)[:sum(lens)], atol=tol, rtol=tol)
        np.testing.assert_allclose(s[writes], np.asarray(s_ref)[slots], atol=tol * 10, rtol=tol)
        np.testing.assert_allclose(s[kept], np.asarray(s_cut)[kept], atol=tol * 10, rtol=tol)
        others = np.setdiff1d(np.arange(10), np.concatenate([writes, kept]))
        np.testing.assert_array_equal(s[others], before[others])
    rng = np.random.default_rng(8)
    K, C = 4, 8
    pool = jnp.asarray(rng.standard_normal((10, K, C)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((T, C)), jnp.float32)
    positions = np.concatenate([np.arange(n) + 5 for n in lens] + [np.zeros(T - sum(lens))]).astype(np.int32)
    in_place = np.asarray(ring_update(x, pool, args[6], args[8], jnp.asarray(positions)))
    known = np.asarray(ring_update(jnp.asarray(np.asarray(x)[np.pad(rows, (0, T - len(rows)))]), pool, args[6],
                                   cut_qs, jnp.asarray(positions[np.pad(rows, (0, T - len(rows)))])))
    moved = np.asarray(ring_update(x, pool, args[6], args[8], jnp.asarray(positions), jnp.asarray(writes),
                                   jnp.asarray(keep, jnp.int32)))
    np.testing.assert_array_equal(moved[writes], in_place[slots])
    np.testing.assert_array_equal(moved[kept], known[kept])
    others = np.setdiff1d(np.arange(1, 10), np.concatenate([writes, kept]))  # (slot 0: the scratch slot)
    np.testing.assert_array_equal(moved[others], np.asarray(pool)[others])
