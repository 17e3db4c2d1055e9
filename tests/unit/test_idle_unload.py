"""Idle unloading's choice of buckets (jinfer/engine/idle_unload.py), without an engine: the pure rule, then the
registry part over fake executables (what a step marks, what an unload drops from the ready sets and `_compiled`).
The engine-level cycle (unload, padded steps, reload from the executable cache) is in test_engine.py."""

import threading
import time

import pytest

from jinfer.engine.idle_unload import KEEP_RECENT_BUCKETS, IdleUnloading, idle_buckets


def test_idle_buckets_keeps_pinned_busy_and_the_last_used():
    last = {(8, 0): 0.0, (16, 0): 1.0, (32, 0): 2.0, (64, 0): 3.0, (16, 1): 4.0, (256, 0): 0.0}
    stepped = {(8, 0): 5.0, (16, 0): 1.0, (32, 0): 2.0, (16, 1): 4.0}  # (64, 0): made ready, never stepped
    pinned, busy = {(8, 0), (256, 0)}, {(32, 0)}
    # before the keep-alive ran out, nothing
    assert idle_buckets(last, stepped, 4.5, 10.0, pinned, busy, 2) == []
    # (8, 0) was stepped last but is pinned: it takes no place among the recent; kept: (16, 1) and (32, 0), which is
    # busy anyway (an unloaded bucket is never dropped twice)
    assert sorted(idle_buckets(last, stepped, 100.0, 10.0, pinned, busy, 2)) == [(16, 0), (64, 0)]
    assert sorted(idle_buckets(last, stepped, 100.0, 10.0, pinned, set(), 1)) == [(16, 0), (32, 0), (64, 0)]
    assert sorted(idle_buckets(last, stepped, 100.0, 10.0, pinned, set(), 0)) == [(16, 0), (16, 1), (32, 0), (64, 0)]
    # with no step at all (only a warm-up), every unpinned bucket goes
    assert sorted(idle_buckets(last, {}, 100.0, 10.0, pinned, set(), 2)) == [(16, 0), (16, 1), (32, 0), (64, 0)]
    # a kept bucket is only kept while no two others were stepped after it
    later = {**stepped, (64, 0): 6.0, (16, 0): 7.0}
    assert sorted(idle_buckets(last, later, 100.0, 10.0, pinned, set(), 2)) == [(16, 1), (32, 0)]


@pytest.mark.parametrize("keep_alive, keep_recent", [(0.0, 2), (-1.0, 2), (10.0, -1)])
def test_idle_buckets_rejects_bad_arguments(keep_alive, keep_recent):
    with pytest.raises(ValueError, match="keep_alive=.*keep_recent="):
        idle_buckets({}, {}, 0.0, keep_alive, set(), set(), keep_recent)


class FakeRegistry(IdleUnloading):
    """The registry attributes idle unloading works on, over fake executables: buckets 8..256, one P bucket, a
    decode-only kind from 16 up, a sequence bucket of min(T, 64)."""

    def __init__(self):
        self.token_buckets = (8, 16, 32, 64, 128, 256)
        self.decode_buckets = frozenset({16, 32, 64})
        self.ready_tokens, self.ready_decode, self.ready_verify = self.token_buckets, self.decode_buckets, frozenset()
        self._background, self._ready_lock = None, threading.Lock()
        self._init_idle(keep_alive=60.0)
        self._pinned = frozenset({(8, 0), (256, 0)})
        self._compiled = {}
        for T in self.token_buckets:
            for kind in self.kinds(T):
                self._compiled[("forward_decode" if kind else "forward", T, self.seqs_bucket(T), 32)] = object()
                self._last_used[(T, kind)] = 0.0  # made ready at the warm-up's end
            self._compiled |= dict.fromkeys(self._warm_sampler_keys(self.seqs_bucket(T)), object())

    def seqs_bucket(self, T):
        return min(T, 64)

    def kinds(self, T):
        return (0, 1) if T in self.decode_buckets else (0,)

    def ready_limits(self):
        return self.ready_tokens[-1], self.seqs_bucket(self.ready_tokens[-1])

    def _warm_sampler_keys(self, B):
        return {("sample", B, "greedy"), ("sample", B, "random")}


def test_unload_keeps_what_the_last_traffic_used():
    reg = FakeRegistry()
    assert reg.keep_recent == KEEP_RECENT_BUCKETS == 2
    # traffic: a 100-token prompt (bucket 128), decode-only steps of 20 sequences (32 decode), then of 1 (8, pinned)
    reg._note_use(128, 0, 100, 0)
    reg._note_use(32, 1, 20, 1)
    reg._note_use(8, 0, 1, 1)
    assert reg.unload_idle(now=30.0) == 0  # (the warm-up's marks are 30 s old: within the keep-alive)
    assert reg.unload_idle(now=time.monotonic() + 61) == 5  # 16, 32, 64, 16 decode, 64 decode; 128, 32 decode kept
    assert reg.ready_tokens == (8, 128, 256) and reg.ready_decode == {32}
    assert reg._unloaded == {(16, 0), (32, 0), (64, 0), (16, 1), (64, 1)}
    forwards = sorted((k[0], k[1]) for k in reg._compiled if k[0].startswith("forward"))
    assert forwards == [("forward", 8), ("forward", 128), ("forward", 256), ("forward_decode", 32)]
    # samplers of a sequence bucket no loaded bucket has: 16's only (32 decode keeps 32's, 128 and 256 keep 64's)
    assert {k[1] for k in reg._compiled if k[0] == "sample"} == {8, 32, 64}
    assert reg.unloads == 5 and reg.unload_idle(now=time.monotonic() + 600) == 0
