"""batch_builder.build_batch: its per-token path for small steps builds the same padded batch as its numpy path, and
packs it as `step_inputs.pack_batch` does."""

from dataclasses import asdict
from types import SimpleNamespace

import numpy as np
import pytest

from jinfer.engine import batch_builder
from jinfer.engine.batch_builder import build_batch
from jinfer.engine.request import device_input
from jinfer.engine.step_inputs import pack_batch


def schedule(rng, n: int, page_size: int):
    scheduled, prev_rows = [], {}
    for i in range(n):
        start = int(rng.integers(0, 40))
        drafts = int(rng.integers(0, 4))
        num_new = int(rng.choice([1 + drafts, int(rng.integers(1, 12))]))  # a decode (+ drafts) or a prefill chunk
        needs_sample = bool(rng.random() < 0.8)
        from_device = bool(rng.random() < 0.3)
        pages = rng.integers(1, 100, -(-(start + num_new) // page_size)).tolist()
        rid = f"r{i}"
        prev_rows[rid] = int(rng.integers(0, 8))
        tokens = rng.integers(3, 200, num_new).tolist()
        verify = needs_sample and num_new == 1 + drafts and drafts
        on_device = bool(verify and rng.random() < 0.5)
        if on_device:  # drafts the device holds (request.device_input)
            tokens[1:] = [device_input(int(x)) for x in rng.integers(100, 2048, drafts)]
        scheduled.append(SimpleNamespace(
            request_id=rid, num_new_tokens=num_new, start=start, page_ids=pages,
            draft_token_ids=tokens[1:] if verify else [], device_drafts=on_device,
            token_ids=tokens, input_from_device=from_device,
            num_logits=(num_new if num_new == 1 + drafts else 1) if needs_sample else 0,
            needs_sample=needs_sample, state_slot=int(rng.integers(0, 4)), state_write_slot=int(rng.integers(0, 8)),
            state_keep=int(rng.integers(0, num_new + 1)), shift_from=int(rng.integers(-1, 3)) if from_device else -1))
    total = sum(s.num_new_tokens for s in scheduled)
    return SimpleNamespace(scheduled=scheduled, num_scheduled_tokens=total), prev_rows


@pytest.mark.parametrize("seed", range(20))
def test_small_steps_match_the_numpy_path(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    out, prev_rows = schedule(rng, n, page_size=4)
    T = max(8, 1 << (out.num_scheduled_tokens - 1).bit_length())
    small = build_batch(out, prev_rows, T, 8, 16, 4)
    monkeypatch.setattr(batch_builder, "SMALL_STEP", 0)
    big = build_batch(out, prev_rows, T, 8, 16, 4)
    assert small.R == big.R and small.rows == big.rows
    for a, b in [*zip(asdict(small.batch).values(), asdict(big.batch).values()), (small.prev_index, big.prev_index),
                 (small.counts, big.counts), (small.shift_from, big.shift_from)]:
        assert a.dtype == b.dtype == np.int32
        np.testing.assert_array_equal(a, b)
    assert big.packed is None
    np.testing.assert_array_equal(small.packed, pack_batch(big.batch, big.prev_index, big.shift_from))
    assert big.shift_from.tolist() == [s.shift_from for s in out.scheduled] + [-1] * (8 - n)
    for s, lo in zip(out.scheduled, big.batch.query_start):  # device drafts: read from the device's rows, id 0
        marked = np.asarray(s.token_ids) <= -2
        rows = lo + np.flatnonzero(marked)
        np.testing.assert_array_equal(big.prev_index[rows], -2 - np.asarray(s.token_ids)[marked])
        assert not big.batch.input_ids[rows].any()
    assert small.packed.dtype == np.int32
