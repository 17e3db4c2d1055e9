"""sampling_inputs.SamplingInputs: steps whose rows need only their parameters, seed and step are built from the rows
kept across steps, and equal the buffer built row by row (padding rows' seeds aside); other steps are built row by
row."""

from dataclasses import astuple
from types import SimpleNamespace

import numpy as np
import pytest

from jinfer.engine.batch_builder import StepRow, logits_rows, sampling_tensors, with_pending_output
from jinfer.engine.sampling_inputs import SamplingInputs
from jinfer.engine.sampling_tensors import SamplerFlags
from jinfer.engine.step_inputs import pack_sampling
from jinfer.sampling_params import SamplingParams

V = 64


def row_by_row(rows, out, counts, R, prev_rows=None):
    if prev_rows is not None:
        rows = [with_pending_output(r, s, prev_rows) for r, s in zip(rows, out.scheduled)]
    st = sampling_tensors(logits_rows(rows, out, counts), R, V, None, counts)
    return pack_sampling(st), SamplerFlags.of(st)


def assert_same(got, want, rows, counts, R):
    """Equal buffers but for the seeds of rows that sample nothing (padding: drawn at random per build)."""
    sampled = np.zeros(R, bool)
    first = np.concatenate([[0], np.cumsum(counts)])
    for b, r in enumerate(rows):
        sampled[first[b]:first[b + 1]] = r is not None
    got, want = got.copy(), want.copy()
    seeds = slice(7 * R, 8 * R)
    got[seeds][~sampled] = want[seeds][~sampled] = 0
    np.testing.assert_array_equal(got, want)


def step(rows, out, counts, n):
    """The same sequences n tokens later."""
    return [r if r is None else StepRow(r.params, [*r.output_ids, *range(n)], r.prompt, r.seed, r.step + n,
                                        r.min_tokens_ids, r.allowed, r.bad_words, r.guided) for r in rows]


def batch(rng, params_of):
    n = int(rng.integers(1, 6))
    counts = rng.integers(1, 5, n).astype(np.int32)
    scheduled, rows = [], []
    for b in range(n):
        drafts = rng.integers(0, V, counts[b] - 1).tolist()
        scheduled.append(SimpleNamespace(request_id=f"r{b}", draft_token_ids=drafts, input_from_device=True))
        if counts[b] == 1 and rng.random() < 0.25:
            rows.append(None)  # a prefill chunk: no sample
            continue
        rows.append(StepRow(params_of(rng, b), rng.integers(0, V, 5).tolist(), None, int(rng.integers(0, 2**40)),
                            int(rng.integers(counts[b] + 4, 50)), (1, 2)))
    R = int(max(8, counts.sum()))
    return rows, SimpleNamespace(scheduled=scheduled), counts, R


def plain(rng, b):
    return SamplingParams(temperature=float(rng.choice([0.0, 0.7])), top_k=int(rng.choice([-1, 5])),
                          top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.1])))


@pytest.mark.parametrize("seed", range(8))
def test_steps_of_static_rows_are_built_from_kept_rows(seed):
    rng = np.random.default_rng(seed)
    rows, out, counts, R = batch(rng, plain)
    inputs = SamplingInputs(V)
    first = inputs.build(rows, out, counts, R)
    want, flags = row_by_row(rows, out, counts, R)
    assert_same(first.buffer, want, rows, counts, R)
    assert first.flags == astuple(flags) and (first.M, first.W, first.K) == (0, 0, 0)
    # later: other steps, other logits rows per sequence (drafts vary), a sequence gone
    later = step(rows, out, counts, 3)[1:] or rows
    out2 = SimpleNamespace(scheduled=out.scheduled[len(rows) - len(later):])
    counts2 = rng.integers(1, 5, len(later)).astype(np.int32)
    counts2[[r is None for r in later]] = 1
    R2 = int(max(8, counts2.sum()))
    got = inputs.build(later, out2, counts2, R2, prev_rows={f"r{b}": b for b in range(len(rows))})
    assert (inputs.hits, inputs.misses) == (2, 0)
    want, flags = row_by_row(later, out2, counts2, R2)
    assert_same(got.buffer, want, later, counts2, R2)
    assert got.flags == astuple(flags)


def test_kept_rows_hold_their_parameters():
    """A kept row is keyed by its parameters' id: it holds them, so no new object takes that id."""
    inputs = SamplingInputs(V)
    out = SimpleNamespace(scheduled=[SimpleNamespace(request_id="r0", draft_token_ids=[], input_from_device=False)])
    counts = np.array([1], np.int32)
    for i in range(50):
        rows = [StepRow(SamplingParams(temperature=0.01 * i, top_k=i % 7 or -1), [], None, 3, 10)]
        got = inputs.build(rows, out, counts, 8)
        assert_same(got.buffer, row_by_row(rows, out, counts, 8)[0], rows, counts, 8)
    assert inputs.hits == 50


@pytest.mark.parametrize("kind", ["penalty", "bias", "bad_words", "min_tokens"])
def test_rows_with_step_dependent_inputs_are_never_reused(kind):
    """Penalties read the outputs, bad words ban per output, min_tokens masks stop ids until it is reached; a logit
    bias is static but takes the biases' part of the buffer (not cached either)."""
    rng = np.random.default_rng(1)
    params = {"penalty": SamplingParams(presence_penalty=0.5), "bias": SamplingParams(logit_bias={3: 1.0}),
              "min_tokens": SamplingParams(min_tokens=60, max_tokens=100)}.get(kind, SamplingParams())
    rows, out, counts, R = batch(rng, lambda rng, b: params)
    rows = [r or StepRow(params, [], None, 0, 10) for r in rows]
    if kind == "bad_words":
        rows = [StepRow(r.params, r.output_ids, None, r.seed, r.step, bad_words=((7,),)) for r in rows]
    prev_rows = {f"r{b}": b for b in range(len(rows))}
    inputs = SamplingInputs(V)
    for n in (0, 1, 2):
        later = step(rows, out, counts, n)
        got = inputs.build(later, out, counts, R, prev_rows=prev_rows)
        assert_same(got.buffer, row_by_row(later, out, counts, R, prev_rows)[0], later, counts, R)
    assert inputs.hits == 0


def test_min_tokens_reached_rows_are_reused():
    """Once every row's first logits row is past min_tokens, its stop ids are no longer masked: the rows are static."""
    params = SamplingParams(min_tokens=10)
    out = SimpleNamespace(scheduled=[SimpleNamespace(request_id="r0", draft_token_ids=[5, 6], input_from_device=False)])
    counts, R = np.array([3], np.int32), 8
    inputs = SamplingInputs(V)
    steps = [10, 11, 12, 13, 14]  # first rows 8 ... 12: masked until step 12's
    for s in steps:
        rows = [StepRow(params, [], None, 1, s, (1, 2))]
        got = inputs.build(rows, out, counts, R)
        assert_same(got.buffer, row_by_row(rows, out, counts, R)[0], rows, counts, R)
    assert (inputs.hits, inputs.misses) == (3, 2)
