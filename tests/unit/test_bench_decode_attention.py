"""bench_decode_attention's inputs: every chained call reads its own pages, placed as asked."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.bench_decode_attention import PLACEMENTS, inputs


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_tables_are_disjoint_and_placed(placement):
    q, k, v, tables, lens = inputs(3, 40, 4, 2, 16, 8, 2, placement)
    t = np.asarray(tables)  # [chain, batch, pages per seq]
    assert t.shape == (2, 3, 5) and q.shape == (3, 4, 16) and k.shape == v.shape == (30, 8, 2, 16)
    assert sorted(t.ravel().tolist()) == list(range(30))  # each page used once over the chain
    assert np.asarray(lens).tolist() == [40] * 3
    ranges = np.arange(30).reshape(2, 3, 5)
    if placement == "contiguous":
        assert (t == ranges).all()
    if placement == "shuffled":  # a sequence's own range, reordered
        assert (np.sort(t, axis=2) == ranges).all() and not (t == ranges).all()
