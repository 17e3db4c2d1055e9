"""Scheduler behaviour with exact page ids; model outputs are simulated with fixed token ids."""

import random
from collections import Counter

import pytest

from jinfer.cache.manager import KVCacheManager
from jinfer.config.engine import SchedulerConfig
from jinfer.engine.request import FinishReason, Request, RequestStatus
from jinfer.engine.scheduler import Scheduler
from jinfer.sampling_params import SamplingParams

PS = 4  # page size
EOS = 2
TOK = 7  # the default "sampled" token: not EOS


def make_sched(num_pages: int = 17, max_model_len: int = 64, prefix: bool = True, **cfg) -> Scheduler:
    kv = KVCacheManager(num_pages, PS, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_model_len=max_model_len, **cfg), kv)


def make_req(rid: str, n: int, base: int = 100, **sp) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(**sp), eos_token_ids=(EOS,))


def add(sched: Scheduler, *reqs: Request) -> None:
    for r in reqs:
        sched.add_request(r)


def step(sched: Scheduler, tokens: dict[str, int] | None = None):
    """One engine step; returns (batch summary, output, finished requests)."""
    out = sched.schedule()
    summary = [(s.request_id, s.start, s.num_new_tokens, list(s.page_ids)) for s in out.scheduled]
    sampled = {s.request_id: [(tokens or {}).get(s.request_id, TOK)] for s in out.scheduled if s.needs_sample}
    return summary, out, sched.update(out, sampled)


def test_prefill_then_decode_until_max_tokens():
    sched = make_sched()
    a = make_req("a", 10, max_tokens=5)
    add(sched, a)
    summary, out, fin = step(sched)
    assert summary == [("a", 0, 10, [1, 2, 3])]
    assert out.scheduled[0].needs_sample and out.scheduled[0].is_last_chunk
    assert a.output_token_ids == [TOK] and a.num_computed_tokens == 10 and a.status == RequestStatus.RUNNING
    assert step(sched)[0] == [("a", 10, 1, [1, 2, 3])]
    assert step(sched)[0] == [("a", 11, 1, [1, 2, 3])]
    assert step(sched)[0] == [("a", 12, 1, [1, 2, 3, 4])]
    summary, out, fin = step(sched)
    assert summary == [("a", 13, 1, [1, 2, 3, 4])]
    assert fin == [a] and a.finish_reason == FinishReason.LENGTH == "length"
    assert a.status == RequestStatus.FINISHED_LENGTH and a.num_output_tokens == 5
    assert sched.kv.num_free_pages == 16 and not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.is_empty and out.finished_ids == ["a"]
    assert sched.schedule().finished_ids == []


def test_chunked_prefill_respects_budget():
    sched = make_sched(max_num_batched_tokens=8)
    a = make_req("a", 20)
    add(sched, a)
    summary, out, _ = step(sched)
    assert summary == [("a", 0, 8, [1, 2])] and not out.scheduled[0].needs_sample
    assert out.scheduled[0].token_ids == list(range(100, 108))
    assert a.output_token_ids == [] and a.num_computed_tokens == 8
    assert step(sched)[0] == [("a", 8, 8, [1, 2, 3, 4])]
    summary, out, _ = step(sched)
    assert summary == [("a", 16, 4, [1, 2, 3, 4, 5])] and out.scheduled[0].needs_sample
    assert a.output_token_ids == [TOK]


def test_decodes_and_prefill_chunk_share_a_step():
    sched = make_sched(max_num_batched_tokens=8)
    add(sched, make_req("a", 3), make_req("b", 20, base=200))
    assert step(sched)[0] == [("a", 0, 3, [1]), ("b", 0, 5, [2, 3])]
    assert step(sched)[0] == [("a", 3, 1, [1]), ("b", 5, 7, [2, 3, 4])]
    summary, out, _ = step(sched)
    assert summary == [("a", 4, 1, [1, 5]), ("b", 12, 7, [2, 3, 4, 6, 7])]
    assert [s.needs_sample for s in out.scheduled] == [True, False]
    summary, out, _ = step(sched)
    assert summary == [("a", 5, 1, [1, 5]), ("b", 19, 1, [2, 3, 4, 6, 7])]
    assert [s.needs_sample for s in out.scheduled] == [True, True]
    assert step(sched)[0] == [("a", 6, 1, [1, 5]), ("b", 20, 1, [2, 3, 4, 6, 7, 8])]


def test_long_prefill_token_threshold():
    sched = make_sched(long_prefill_token_threshold=4)
    add(sched, make_req("a", 10), make_req("b", 2, base=200))
    assert step(sched)[0] == [("a", 0, 4, [1]), ("b", 0, 2, [2])]
    assert step(sched)[0] == [("a", 4, 4, [1, 3]), ("b", 2, 1, [2])]
    assert step(sched)[0] == [("a", 8, 2, [1, 3, 4]), ("b", 3, 1, [2])]


def test_max_num_seqs_caps_running():
    sched = make_sched(max_num_seqs=2)
    a, b = make_req("a", 4, max_tokens=2), make_req("b", 4, base=200, max_tokens=2)
    c = make_req("c", 4, base=300)
    add(sched, a, b, c)
    assert step(sched)[0] == [("a", 0, 4, [1]), ("b", 0, 4, [2])]
    assert sched.num_running == 2 and sched.num_waiting == 1
    summary, _, fin = step(sched)
    assert summary == [("a", 4, 1, [1, 3]), ("b", 4, 1, [2, 4])] and fin == [a, b]
    summary, out, _ = step(sched)
    assert out.finished_ids == ["a", "b"]
    assert summary == [("c", 0, 4, [4])]  # uncached pages 4 and 3 are reused first


def test_no_chunking_waits_for_budget():
    sched = make_sched(max_model_len=16, max_num_batched_tokens=16, enable_chunked_prefill=False)
    add(sched, make_req("a", 10, max_tokens=2), make_req("b", 10, base=200, max_tokens=2))
    assert step(sched)[0] == [("a", 0, 10, [1, 2, 3])]
    assert step(sched)[0] == [("a", 10, 1, [1, 2, 3]), ("b", 0, 10, [4, 5, 6])]


def test_fifo_head_of_line_is_not_overtaken():
    sched = make_sched(num_pages=9, max_model_len=32)
    add(sched, make_req("a", 20, max_tokens=4))
    assert step(sched)[0] == [("a", 0, 20, [1, 2, 3, 4, 5])]
    add(sched, make_req("b", 16, base=200, max_tokens=1), make_req("c", 4, base=300))
    assert step(sched)[0] == [("a", 20, 1, [1, 2, 3, 4, 5, 6])]  # b needs 4 pages, 2 free: c waits too
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_preemption_picks_newest_and_requeues_at_front():
    sched = make_sched(num_pages=7, max_model_len=24, max_num_seqs=3)
    a, b, c = (make_req(r, 4, base=base, max_tokens=8, ignore_eos=True)
               for r, base in (("a", 100), ("b", 200), ("c", 300)))
    d = make_req("d", 4, base=400)
    add(sched, a, b, c, d)
    assert step(sched)[0] == [("a", 0, 4, [1]), ("b", 0, 4, [2]), ("c", 0, 4, [3])]
    assert step(sched)[0] == [("a", 4, 1, [1, 4]), ("b", 4, 1, [2, 5]), ("c", 4, 1, [3, 6])]
    for _ in range(3):
        step(sched)
    assert sched.kv.num_free_pages == 0
    # Position 8 needs a fresh page for everyone: c (newest) is preempted, a and b take its pages.
    summary, out, _ = step(sched)
    assert summary == [("a", 8, 1, [1, 4, 6]), ("b", 8, 1, [2, 5, 3])]
    assert out.preempted_ids == ["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.page_ids == []
    assert c.num_preemptions == 1 and c.output_token_ids == [TOK] * 5  # generated tokens are kept
    assert [r.request_id for r in sched.waiting] == ["c", "d"]  # not admitted in the preempting step
    summary, out, _ = step(sched)  # c would need 3 pages: none free, and d may not overtake it
    assert summary == [("a", 9, 1, [1, 4, 6]), ("b", 9, 1, [2, 5, 3])] and out.preempted_ids == []
    _, _, fin = step(sched)
    assert fin == [a, b]
    # c recomputes prompt + its 5 generated tokens (its cached pages were evicted), then samples.
    summary, out, _ = step(sched)
    assert summary == [("c", 0, 9, [3, 6, 4]), ("d", 0, 4, [1])]
    assert out.scheduled[0].token_ids == list(range(300, 304)) + [TOK] * 5 and out.scheduled[0].needs_sample
    assert c.output_token_ids == [TOK] * 6 and c.num_cached_tokens == 0


def test_preemption_repeats_until_it_fits():
    sched = make_sched(num_pages=5, max_num_batched_tokens=16, long_prefill_token_threshold=8)
    a = make_req("a", 16, max_tokens=1)
    b, c = make_req("b", 4, base=200, max_tokens=2), make_req("c", 4, base=300, max_tokens=2)
    add(sched, a, b, c)
    assert step(sched)[0] == [("a", 0, 8, [1, 2]), ("b", 0, 4, [3]), ("c", 0, 4, [4])]
    summary, out, _ = step(sched)
    assert summary == [("a", 8, 8, [1, 2, 4, 3])]
    assert out.preempted_ids == ["c", "b"]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]  # older victim first


def test_request_preempting_itself():
    sched = make_sched(num_pages=5)
    a, b = make_req("a", 10, max_tokens=3), make_req("b", 4, base=200, max_tokens=2)
    add(sched, a, b)
    assert step(sched)[0] == [("a", 0, 10, [1, 2, 3]), ("b", 0, 4, [4])]
    summary, out, _ = step(sched)  # b's decode needs a page; b is the newest, so it goes
    assert summary == [("a", 10, 1, [1, 2, 3])] and out.preempted_ids == ["b"]
    assert sched.running == [a] and list(sched.waiting) == [b]


def test_prefix_reuse_and_never_the_last_token():
    sched = make_sched()
    a = make_req("a", 8, max_tokens=1)
    add(sched, a)
    assert step(sched)[0] == [("a", 0, 8, [1, 2])]
    b = make_req("b", 8, max_tokens=2)  # same prompt: the last page holds the last token, recomputed
    c = Request("c", list(range(100, 108)) + [5], SamplingParams(), eos_token_ids=(EOS,))
    add(sched, b, c)
    summary, _, _ = step(sched)
    assert summary == [("b", 4, 4, [1, 3]), ("c", 8, 1, [1, 2, 4])]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (4, 8)
    assert sched.kv.ref_count(1) == 2
    assert sched.stats()["prefix_cache_hit_rate"] == pytest.approx(12 / (8 + 8 + 9))


def test_abort_frees_everything():
    sched = make_sched()
    a, b = make_req("a", 10), make_req("b", 10)  # b shares a's first two pages once cached
    add(sched, a)
    step(sched)
    add(sched, b, make_req("w", 4, base=900, max_tokens=4))
    summary, _, _ = step(sched)
    assert summary[1][:3] == ("b", 8, 2) and sched.kv.ref_count(1) == 2
    sched.add_request(make_req("x", 60, base=1000, max_tokens=4))  # waits: not enough pages
    step(sched)
    assert [r.request_id for r in sched.waiting] == ["x"]
    for rid in ("b", "x", "a", "w"):
        assert sched.abort(rid).finish_reason == FinishReason.ABORT
    assert sched.abort("a") is None and sched.abort("nope") is None
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_pages == sched.kv.num_usable_pages and sched.kv.usage == 0.0
    assert sched.num_running == 0 and sched.num_waiting == 0
    out = sched.schedule()
    assert out.is_empty and out.finished_ids == ["b", "x", "a", "w"]


def test_admission_rejects_requests_that_cannot_fit():
    sched = make_sched(num_pages=3, max_model_len=16)  # 2 usable pages = 8 tokens of KV
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_req("a", 10, max_tokens=7))
    with pytest.raises(ValueError, match="no room"):
        sched.add_request(make_req("b", 16, max_tokens=None))
    with pytest.raises(ValueError, match="pages"):
        sched.add_request(make_req("c", 8, max_tokens=2))
    with pytest.raises(ValueError, match="pages"):
        sched.add_request(make_req("d", 4, max_tokens=None))  # could grow to 16 tokens
    sched.add_request(make_req("e", 8, max_tokens=1))  # the last sampled token needs no slot
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_req("e", 4, max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        Request("f", [], SamplingParams())
    assert [r.request_id for r in sched.waiting] == ["e"]


def run_tokens(sched: Scheduler, req: Request, tokens: list[int]) -> list[Request]:
    finished = []
    for tok in tokens:
        _, _, fin = step(sched, {req.request_id: tok})
        finished += fin
    return finished


def test_stop_on_eos_and_ignore_eos():
    sched = make_sched()
    a = make_req("a", 4, max_tokens=10)
    add(sched, a)
    assert run_tokens(sched, a, [5, EOS]) == [a]
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == ("stop", None, [5, EOS])
    b = make_req("b", 4, max_tokens=3, ignore_eos=True)
    add(sched, b)
    assert run_tokens(sched, b, [EOS, EOS, EOS]) == [b]
    assert b.finish_reason == "length" and b.output_token_ids == [EOS] * 3


def test_stop_token_ids_and_min_tokens():
    sched = make_sched()
    a = make_req("a", 4, stop_token_ids=[9])
    add(sched, a)
    assert run_tokens(sched, a, [5, 9]) == [a]
    assert (a.finish_reason, a.stop_reason, a.status) == ("stop", 9, RequestStatus.FINISHED_STOPPED)
    b = make_req("b", 4, stop_token_ids=[9], min_tokens=3)
    add(sched, b)
    assert run_tokens(sched, b, [EOS, 9, 9]) == [b]
    assert b.output_token_ids == [EOS, 9, 9] and b.stop_reason == 9
    assert b.stop_token_ids_while_min_tokens() == (EOS, 9)
    c = make_req("c", 4, max_tokens=2, stop_token_ids=[9])  # stop beats length on the same token
    add(sched, c)
    assert run_tokens(sched, c, [5, 9]) == [c] and c.finish_reason == "stop"


def test_length_at_max_model_len():
    sched = make_sched(max_model_len=8)
    a = make_req("a", 6, max_tokens=None)
    add(sched, a)
    assert run_tokens(sched, a, [5, 5]) == [a]
    assert a.finish_reason == "length" and a.num_tokens == 8


def test_finish_request_with_stop_string():
    sched = make_sched()
    a, b = make_req("a", 4), make_req("b", 4, base=200)
    add(sched, a, b)
    step(sched)
    assert sched.finish_request("a", FinishReason.STOP, "###") is a
    assert (a.finish_reason, a.stop_reason, a.page_ids) == ("stop", "###", [])
    assert sched.finish_request("b", FinishReason.ABORT) is b
    summary, out, _ = step(sched)
    assert summary == [] and out.finished_ids == ["a", "b"]


def test_update_requires_sampled_token():
    sched = make_sched()
    add(sched, make_req("a", 4))
    out = sched.schedule()
    with pytest.raises(KeyError, match="'a'"):
        sched.update(out, {})


@pytest.mark.parametrize("kwargs, field", [
    ({"max_model_len": 0}, "max_model_len"),
    ({"max_model_len": 16, "max_num_seqs": 0}, "max_num_seqs"),
    ({"max_model_len": 16, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_model_len": 16, "long_prefill_token_threshold": 0}, "long_prefill_token_threshold"),
    ({"max_model_len": 4096, "enable_chunked_prefill": False}, "max_num_batched_tokens"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_always_completes(seed):
    """Small pool, many requests: invariants hold each step and every request finishes."""
    rng = random.Random(seed)
    sched = make_sched(num_pages=13, max_model_len=40, max_num_batched_tokens=16, max_num_seqs=4)
    reqs = []
    for i in range(30):
        n = rng.randint(1, 30)
        sp = SamplingParams(max_tokens=rng.randint(1, 40 - n), ignore_eos=rng.random() < 0.5)
        base = rng.choice([0, 0, 1000 * i])  # some shared prefixes
        reqs.append(Request(f"r{i}", list(range(base, base + n)), sp, eos_token_ids=(EOS,)))
    pending = list(reqs)
    num_preempted = 0
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            sched.add_request(pending.pop(0))
        if rng.random() < 0.02 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        out = sched.schedule()
        assert out.num_scheduled_tokens <= 16 and len(sched.running) <= 4
        assert len({s.request_id for s in out.scheduled}) == len(out.scheduled)
        for s in out.scheduled:
            assert s.start + s.num_new_tokens <= len(s.page_ids) * PS
        sampled = {s.request_id: [rng.choice([TOK, TOK, TOK, EOS])] for s in out.scheduled if s.needs_sample}
        sched.update(out, sampled)
        refs = Counter(p for r in sched.running for p in r.page_ids)
        assert all(sched.kv.ref_count(p) == c for p, c in refs.items())
        assert sched.kv.num_usable_pages - sched.kv.num_free_pages == len(refs)
        assert all(not r.page_ids for r in sched.waiting)
        num_preempted += len(out.preempted_ids)
        if not pending and not sched.has_unfinished_requests():
            break
    assert not pending and not sched.has_unfinished_requests()
    assert all(r.is_finished for r in reqs)
    assert sched.kv.num_free_pages == sched.kv.num_usable_pages
    assert num_preempted > 0 and sched.kv.num_hit_tokens > 0  # the workload exercised both
    for r in reqs:
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.sampling_params.max_tokens


def test_one_step_in_flight():
    """Async scheduling: step N+1 is scheduled before step N's tokens are known."""
    sched = make_sched()
    a, b = make_req("a", 6, max_tokens=3), make_req("b", 5, base=200, max_tokens=10)
    add(sched, a, b)
    out1 = sched.schedule()  # both prefills; each samples a token that is not known yet
    assert [(s.request_id, s.start, s.num_new_tokens, s.needs_sample, s.input_from_device)
            for s in out1.scheduled] == [("a", 0, 6, True, False), ("b", 0, 5, True, False)]
    assert (a.num_computed_tokens, a.num_pending_tokens, a.num_tokens) == (6, 1, 6)
    out2 = sched.schedule()  # decodes of the pending tokens, fed from the device
    assert [(s.request_id, s.start, s.num_new_tokens, s.needs_sample, s.input_from_device)
            for s in out2.scheduled] == [("a", 6, 1, True, True), ("b", 5, 1, True, True)]
    assert a.page_ids == [1, 2] and b.page_ids == [3, 4]  # position 6 of a needs its second page
    assert sched.update(out1, {"a": [TOK], "b": [EOS]}) == [b]  # b stops: its in-flight token is dropped
    assert a.output_token_ids == [TOK] and a.num_pending_tokens == 1 and b.page_ids == []
    out3 = sched.schedule()
    assert [(s.request_id, s.start, s.input_from_device) for s in out3.scheduled] == [("a", 7, True)]
    assert sched.update(out2, {"a": [11], "b": [12]}) == [] and b.output_token_ids == [EOS]
    # a's third token (max_tokens=3) is pending: it is certainly the last, so nothing is scheduled
    assert sched.schedule().is_empty
    assert sched.update(out3, {"a": [13]}) == [a] and a.output_token_ids == [TOK, 11, 13]
    assert a.finish_reason == FinishReason.LENGTH and not sched.has_unfinished_requests()
    assert sched.kv.num_free_pages == sched.kv.num_usable_pages


def test_preempted_with_a_token_in_flight():
    sched = make_sched(num_pages=5)  # 4 usable pages of 4 tokens
    a, b = make_req("a", 8, max_tokens=8, ignore_eos=True), make_req("b", 7, base=300, max_tokens=8,
                                                                      ignore_eos=True)
    add(sched, a, b)
    out1 = sched.schedule()
    assert [s.request_id for s in out1.scheduled] == ["a", "b"]
    out2 = sched.schedule()  # a needs a third page at position 8: b (newest) is preempted
    assert out2.preempted_ids == ["b"] and [s.request_id for s in out2.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_pending_tokens == 1
    out3 = sched.schedule()  # b may not be readmitted while its token is in flight
    assert [s.request_id for s in out3.scheduled] == ["a"] and b.status == RequestStatus.PREEMPTED
    sched.update(out1, {"a": [TOK], "b": [33]})
    assert b.output_token_ids == [33] and b.num_pending_tokens == 0 and b.num_computed_tokens == 0
    sched.update(out2, {"a": [TOK]})
    sched.update(out3, {"a": [TOK]})
    assert len(a.output_token_ids) == 3


def make_state_sched(num_pages: int = 17, slots: int = 5, **cfg) -> Scheduler:
    kv = KVCacheManager(num_pages, PS, enable_prefix_caching=False, num_state_slots=slots)
    return Scheduler(SchedulerConfig(max_model_len=64, **cfg), kv)


def add_forked(sched: Scheduler, n: int = 3, prompt: int = 10) -> list[Request]:
    reqs = [make_req(r, prompt, max_tokens=3) for r in "abcdefgh"[:n]]
    sched.add_request(reqs[0])
    for r in reqs[1:]:
        sched.add_request(r, fork_of="a")
    return reqs


def test_fork_followers_share_the_leaders_full_pages_and_copy_the_rest():
    sched = make_state_sched()
    a, b, c = add_forked(sched)
    assert sched.num_waiting == 3
    summary, out, _ = step(sched)  # the leader stops one token short of its prompt's end
    assert summary == [("a", 0, 9, [1, 2, 3])] and not out.scheduled[0].needs_sample and not out.fork_slots
    summary, out, _ = step(sched)
    # b and c hold a's 9 tokens: pages 1 and 2 shared, page 3 (token 8) copied to a page of their own, and the
    # state slot copied; each sample computes the last prompt token and samples its own first token
    assert summary == [("a", 9, 1, [1, 2, 3]), ("b", 9, 1, [1, 2, 4]), ("c", 9, 1, [1, 2, 5])]
    assert out.fork_pages == [(3, 4), (3, 5)] and out.fork_slots == [(1, 2), (1, 3)]
    assert [sched.kv.ref_count(p) for p in (1, 2, 3, 4, 5)] == [3, 3, 1, 1, 1]
    assert all(s.needs_sample for s in out.scheduled) and (b.num_cached_tokens, c.num_cached_tokens) == (9, 9)
    while sched.has_unfinished_requests():
        step(sched)
    assert [r.num_output_tokens for r in (a, b, c)] == [3, 3, 3]
    assert sched.kv.num_free_pages == 16 and sched.kv.num_free_state_slots == 4


def test_fork_at_a_page_boundary_copies_no_page():
    sched = make_state_sched()
    add_forked(sched, n=2, prompt=9)
    step(sched)
    summary, out, _ = step(sched)
    assert summary == [("a", 8, 1, [1, 2, 3]), ("b", 8, 1, [1, 2, 4])]
    assert out.fork_pages == [] and out.fork_slots == [(1, 2)]


def test_fork_followers_without_room_or_leader_run_alone():
    sched = make_state_sched(max_num_seqs=2)
    a, b, c = add_forked(sched)
    step(sched)
    summary, out, _ = step(sched)  # room for one follower: c queues as a plain request
    assert [s[0] for s in summary] == ["a", "b"] and out.fork_slots == [(1, 2)] and list(sched.waiting) == [c]

    sched = make_state_sched()
    a, b, c, d = add_forked(sched, n=4)
    step(sched)
    sched.abort("c")  # a follower not yet forked
    sched.abort("a")  # the leader: its followers queue as plain requests, in order
    summary, out, _ = step(sched)
    assert summary == [("b", 0, 10, [1, 2, 3]), ("d", 0, 10, [4, 5, 6])] and not out.fork_slots
    assert c.finish_reason == FinishReason.ABORT and sched.num_waiting == 0


def test_fork_of_must_name_a_queued_request_with_the_same_prompt():
    sched = make_state_sched()
    sched.add_request(make_req("a", 10))
    with pytest.raises(ValueError, match="cannot fork"):
        sched.add_request(make_req("b", 10, base=5), fork_of="a")
    with pytest.raises(ValueError, match="cannot fork"):
        sched.add_request(make_req("c", 10), fork_of="nobody")
    step(sched)
    with pytest.raises(ValueError, match="cannot fork"):  # already computing
        sched.add_request(make_req("d", 10), fork_of="a")
