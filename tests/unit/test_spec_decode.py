"""Speculative decoding without a model: the config (vLLM's form), the n-gram drafter against a brute-force reading
of vLLM's rule, the acceptance rule's distribution through the real sampler (chi-square), the scheduler's guard
against scheduling past drafts in flight, and the replay drafter."""

import types

import numpy as np
import pytest

from jinfer.cache.manager import KVCacheManager
from jinfer.config.engine import EngineConfig
from jinfer.config.speculative import SpeculativeConfig
from jinfer.engine.batch_builder import StepRow, logits_rows, sampling_tensors
from jinfer.engine.request import DEVICE_TOKEN, Request, accept_draft_tokens
from jinfer.engine.sampler import sample
from jinfer.engine.scheduler import Scheduler, SchedulerConfig
from jinfer.sampling_params import SamplingParams
from jinfer.spec.ngram import NgramProposer, propose_ngram
from jinfer.spec.proposer import build_proposer
from jinfer.spec.replay import ForcedAcceptance, ReplayProposer

# ---- config ------------------------------------------------------------------------------------------------------


def test_config_parses_vllm_forms_and_defaults():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 5, 5)
    c = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 4)
    e = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    assert e.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                                     prompt_lookup_max=2)
    import dataclasses  # the engine process gets the fields and builds the same config

    assert EngineConfig(**dataclasses.asdict(e)) == e
    assert SpeculativeConfig.parse({"method": "eagle3", "model": "x/y", "num_speculative_tokens": 3}).model == "x/y"
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1}).method == "mtp"
    assert SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 1, "quantization": "fp8"}).quantization \
        == "fp8"


@pytest.mark.parametrize("value, field", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     "prompt_lookup_min"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown fields"),
    ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "fp8"}, "quantization"),
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2, "quantization": "int4"}, "quantization"),
    ("{not json", "not valid JSON"),
])
def test_bad_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(speculative_config=value)


def test_model_drafters_need_their_head_and_eagle3_is_refused_on_recurrent_state_models():
    with pytest.raises(ValueError, match="needs the loaded head"):
        build_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=1), max_model_len=64, num_state_slots=5)
    with pytest.raises(ValueError, match="recurrent state"):
        build_proposer(SpeculativeConfig(method="eagle3", model="x", num_speculative_tokens=1), max_model_len=64,
                       num_state_slots=5)


# ---- the n-gram drafter --------------------------------------------------------------------------------------------


def reference_ngram(t: list[int], lo: int, hi: int, k: int) -> list[int]:
    """vLLM's rule, read literally: the longest n in [lo, hi] whose suffix occurs earlier (ending before the last
    token), its earliest occurrence, the k tokens after it."""
    L = len(t)
    for n in range(min(hi, L - 1), lo - 1, -1):
        suffix = t[L - n:]
        for start in range(0, L - n):
            if t[start:start + n] == suffix:
                return t[start + n:start + n + k]
    return []


def test_ngram_matches_the_reference_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(600):
        L = int(rng.integers(1, 60))
        vocab = int(rng.choice([2, 3, 5, 20]))
        t = rng.integers(0, vocab, L).tolist()
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 6))
        want = reference_ngram(t, lo, hi, k)
        arr = np.asarray(t, np.int32)
        assert propose_ngram(arr, lo, hi, k, t).tolist() == want, (t, lo, hi, k)
        assert propose_ngram(arr, lo, hi, k).tolist() == want, (t, lo, hi, k)  # the vectorised path
        checked += bool(want)
    assert checked > 200


class Seq:  # what the drafter reads of a Request (weak-referenceable, as a Request is)
    def __init__(self, rid, tokens):
        self.request_id, self.all_token_ids = rid, tokens


def test_ngram_proposer_examples_and_incremental_buffers():
    p = NgramProposer(3, 2, 3, max_model_len=12)
    r = Seq("a", [1, 2, 3, 4, 1, 2])
    assert p.propose([r]) == [[3, 4, 1]]  # "1 2" occurred at the start
    r.all_token_ids += [3, 9]
    assert p.propose([r]) == [[]]  # "3 9" never occurred
    r.all_token_ids += [1, 2, 3]  # 11 tokens: room for 1 draft within max_model_len=12
    assert p.propose([r]) == [[4]]  # "1 2 3" (n=3) at 0 -> 4
    long = Seq("b", [7] * 200)
    assert p.propose([long]) == [[]]  # no room left in max_model_len
    p = NgramProposer(4, 1, 2, max_model_len=1000)
    assert p.propose([long, r]) == [[7, 7, 7, 7], [4, 1, 2, 3]]
    long.all_token_ids += list(range(300))  # the buffer grows past its capacity
    assert p.propose([long]) == [[]] and p._tokens(long).tolist() == long.all_token_ids


# ---- the acceptance rule's distribution ----------------------------------------------------------------------------


def _verify(p0_logits, p1_logits, draft: int, n: int, seed0: int = 0):
    """n verifications of one draft through the real host path (logits_rows: each position its own noise step) and the
    real sampler, then accept_draft_tokens: the emitted token lists."""
    params = SamplingParams(temperature=1.0)
    rows = [StepRow(params, [], None, seed0 + i, step=1) for i in range(n)]  # step of the last row (bonus)
    s = types.SimpleNamespace(draft_token_ids=[draft])
    counts = np.full(n, 2, np.int32)
    per_row = logits_rows(rows, types.SimpleNamespace(scheduled=[s] * n), counts)
    assert [r.step for r in per_row[:2]] == [0, 1]
    st = sampling_tensors(per_row, 2 * n, len(p0_logits))
    logits = np.tile(np.stack([p0_logits, p1_logits]), (n, 1)).astype(np.float32)
    tokens = np.asarray(sample(logits, st).tokens).reshape(n, 2)
    return [accept_draft_tokens([draft], pair.tolist()) for pair in tokens]


def chi2(counts, probs):
    e = probs * counts.sum()
    keep = e > 0
    assert counts[~keep].sum() == 0
    return float(((counts[keep] - e[keep]) ** 2 / e[keep]).sum())


def test_emitted_tokens_follow_the_target_distribution():
    """One-hot drafts, accepted while the target's sample equals them: the first emitted token is distributed as the
    target p0 whatever the draft, and the bonus token after an accepted draft as p1. A wrong rule fails the same
    statistic: accepting the draft with probability p(d) and on rejection emitting an independent sample from p (not
    the residual) gives P(d) = p(d) + (1 - p(d)) p(d): with p(d) = 0.4, 0.64 instead of 0.4 (chi2 in the thousands);
    always accepting the draft gives P(d) = 1."""
    V, n = 6, 4000
    p0_logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    p1_logits = np.log(np.array([0.05, 0.05, 0.3, 0.3, 0.2, 0.1]))
    p0, p1 = np.exp(p0_logits), np.exp(p1_logits)
    for draft in (0, 3):  # a likely and an unlikely draft
        out = _verify(p0_logits, p1_logits, draft, n, seed0=draft * n)
        first = np.bincount([o[0] for o in out], minlength=V)
        assert chi2(first, p0) < 25, (draft, first)  # df 5: p ~ 1e-4
        bonus = np.bincount([o[1] for o in out if len(o) == 2], minlength=V)
        assert all(o[0] == draft for o in out if len(o) == 2) and bonus.sum() > 100
        assert chi2(bonus, p1) < 25, (draft, bonus)
        assert all((len(o) == 2) == (o[0] == draft) for o in out)
    # the statistic's power: the wrong rule described above
    rng = np.random.default_rng(1)
    draft = 0
    wrong = [draft if rng.random() < p0[draft] else int(rng.choice(V, p=p0)) for _ in range(n)]
    assert chi2(np.bincount(wrong, minlength=V), p0) > 200


# ---- the scheduler never runs past drafts in flight ----------------------------------------------------------------


def test_a_request_with_drafts_in_flight_is_not_scheduled_again():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=32), kv)
    a, b = Request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=20)), Request("b", [1, 2], SamplingParams())
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, {"a": [10], "b": [3]})
    a.add_draft_tokens([11, 12])
    first = sched.schedule()  # a verifies 2 drafts, b decodes
    assert a.pending_token_ids == [11, 12, DEVICE_TOKEN] and a.has_drafts_in_flight
    assert not b.has_drafts_in_flight
    second = sched.schedule()  # (async) with the first in flight: b decodes again, a waits
    assert [s.request_id for s in second.scheduled] == ["b"]
    sched.update(first, {"a": [11, 40], "b": [4]})  # one draft accepted, then 40
    assert a.output_token_ids == [10, 11, 40] and a.num_computed_tokens == a.num_tokens - 1
    sched.update(second, {"b": [5]})
    third = sched.schedule()
    assert [(s.request_id, s.start) for s in third.scheduled] == [("a", 7), ("b", 4)]


def test_only_accepted_tokens_enter_the_prefix_cache():
    kv = KVCacheManager(64, 4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_batched_tokens=32), kv)
    a = Request("a", [5, 6, 7], SamplingParams(max_tokens=20))
    sched.add_request(a)
    sched.update(sched.schedule(), {"a": [8]})  # 4 tokens, 3 computed
    a.add_draft_tokens([9, 10, 11, 12, 13])  # a row computing positions 3..8: two pages' worth
    out = sched.schedule()
    sched.update(out, {"a": [9, 50]})  # the second draft rejected: 6 tokens, 5 computed
    assert a.num_computed_tokens == 5 and len(a.page_hashes) == 1  # only page 0 (positions 0-3) is full and known
    assert kv._num_registered["a"] == 1


# ---- the replay drafter --------------------------------------------------------------------------------------------


def test_replay_drafter_exact_and_forced():
    """Exact mode: the recording, each token right with probability p (else wrong), no draft without a recording.
    Forced mode: the drafter plans each verification's accepted count (leading Bernoulli(p) successes), so the
    verifications keep 1 + p + ... + p^k tokens on average whatever the target samples."""
    p = ReplayProposer(4, acceptance=1.0)
    p.record([1, 2], [7, 8, 9, 10, 11, 12])
    ns = types.SimpleNamespace
    r = ns(request_id="x", prompt_token_ids=[1, 2], num_output_tokens=1, all_token_ids=[1, 2, 7])
    other = ns(request_id="y", prompt_token_ids=[3], num_output_tokens=0, all_token_ids=[3, 4])
    assert p.propose([r, other]) == [[8, 9, 10, 11], []]
    p = ReplayProposer(1, acceptance=0.3, seed=0)
    p.record([1], [5] * 2000)
    drafts = [p.propose([ns(request_id="z", prompt_token_ids=[1], num_output_tokens=i, all_token_ids=[1])])[0][0]
              for i in range(2000)]
    assert abs(np.mean(np.array(drafts) == 5) - 0.3) < 0.05 and set(drafts) == {4, 5}
    p = ReplayProposer(3, acceptance=0.6, seed=0, forced=True)
    kept = []
    for i in range(3000):
        draft = p.propose([ns(request_id=str(i), prompt_token_ids=[1], num_output_tokens=0, all_token_ids=[5] * 3)])[0]
        kept.append(len(p.forced_accept(str(i), draft, [9] * (len(draft) + 1))))
    assert abs(np.mean(kept) - (1 + 0.6 + 0.36 + 0.216)) < 0.06
    # each plan: the leading successes of one row of a [requests, k] draw per call
    p = ReplayProposer(4, acceptance=0.5, seed=1, forced=True)
    reqs = [ns(request_id=str(i), prompt_token_ids=[1], num_output_tokens=0, all_token_ids=[5] * 4) for i in range(64)]
    p.propose(reqs)
    right = np.random.default_rng(1).random((64, 4)) < 0.5
    assert [p._trials.planned[str(i)] for i in range(64)] == [4 if row.all() else int(np.argmin(row)) for row in right]


def test_forced_acceptance_keeps_a_model_drafters_drafts_and_work():
    """ForcedAcceptance (benchmarks: a model head's drafts, outcomes forced): the inner drafter's drafts unchanged, its
    prepare hook called with the outcomes planned for the launched rows with drafts (what it returns handed back), and
    the verifications' kept tokens as planned, in launch order per request (the next step may be launched before one
    is read back)."""
    ns = types.SimpleNamespace
    hooks = []
    inner = ns(k=2, propose=lambda reqs: [[7, 8] for _ in reqs],
               prepare=lambda out, built, forced: hooks.append((out, built, dict(forced))) or hooks.append)
    p = ForcedAcceptance(inner, acceptance=0.5, seed=3)
    reqs = [ns(request_id=str(i)) for i in range(2000)]
    assert p.propose(reqs) == [[7, 8]] * 2000 and p.k == 2 and p.forced
    out = ns(scheduled=[ns(request_id=str(i), draft_token_ids=[7, 8]) for i in range(2000)]
             + [ns(request_id="x", draft_token_ids=[], request=ns(num_output_tokens=3))])
    p.prepare(out, "built")("launched")
    p.prepare(out, "built")  # the next step's rows, launched before the first step is read back
    (_, built, first), launched, (_, _, second) = hooks
    assert (built, launched) == ("built", "launched") and "x" not in first and first != second
    kept = [len(p.forced_accept(str(i), [7, 8], [1, 2, 3])) for i in range(2000)]
    assert abs(np.mean(kept) - (1 + 0.5 + 0.25)) < 0.06
    assert [first[str(i)] + 1 for i in range(2000)] == kept
    assert [len(p.forced_accept(str(i), [7, 8], [1, 2, 3])) for i in range(2000)] == [second[str(i)] + 1
                                                                                         for i in range(2000)]
    assert p.forced_accept("x", [], [5]) == [5] and not any(p._plans.values())
    p.prepare(ns(scheduled=[ns(request_id="0", draft_token_ids=[7, 8])]), "built")  # launched, never read back
    p.prepare(ns(scheduled=[ns(request_id="0", draft_token_ids=[], request=ns(num_output_tokens=0))]), "built")
    assert not p._plans.get("0")  # (a new request of that id: its prompt's row drops what the old one left)
    assert ForcedAcceptance(ns(k=1, propose=lambda reqs: [[5]]), 1.0).propose([ns(request_id="a")]) == [[5]]


def test_stats_line_reports_acceptance_per_interval():
    from jinfer.engine.stats_log import StatsLogger

    now = [0.0]
    logger = StatsLogger(10.0, clock=lambda: now[0])
    stats = dict(generation_tokens_total=0, num_running=1, spec_decode_num_drafts=0, spec_decode_num_draft_tokens=0,
                 spec_decode_num_accepted_tokens=0, spec_decode_num_accepted_tokens_per_pos_0=0,
                 spec_decode_num_accepted_tokens_per_pos_1=0)
    now[0] = 10.0
    assert "SpecDecoding" not in logger.maybe_log(stats)  # no drafts yet
    stats.update(generation_tokens_total=300, spec_decode_num_drafts=100, spec_decode_num_draft_tokens=200,
                 spec_decode_num_accepted_tokens=120, spec_decode_num_accepted_tokens_per_pos_0=80,
                 spec_decode_num_accepted_tokens_per_pos_1=40)
    now[0] = 20.0
    line = logger.maybe_log(stats).splitlines()[1]
    assert line == ("Engine 000: SpecDecoding metrics: Mean acceptance length: 2.20, Accepted: 120 tokens, Drafted: "
                    "200 tokens, Per-position acceptance rate: 0.800, 0.400, Avg Draft acceptance rate: 60.0%")


def test_head_step_keeps_the_hosts_drafts_and_starts_the_chain_at_the_last_kept_row():
    """The device side of a model drafter's launch (jinfer/spec/eagle.py): the drafts each verification keeps equal
    the host's exact rule (`accept_draft_tokens`) or the forced count; the head's rows take the kept drafts and the
    sample after them, write nothing past them, and its chain starts at the last kept row."""
    from jinfer.models.batch import Batch
    from jinfer.spec.eagle import accepted_drafts, head_rows

    rng = np.random.default_rng(0)
    K, B = 4, 64
    count = rng.integers(0, K + 2, B).astype(np.int32)  # sampled rows: 0 (mid-prefill) .. 1 + K
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int32)
    tokens = rng.integers(0, 3, int(count.sum()) + 8).astype(np.int32)  # 3 ids: drafts often match
    drafts = np.full((B, K), -1, np.int32)
    for b in range(B):
        drafts[b, :max(count[b] - 1, 0)] = rng.integers(0, 3, max(count[b] - 1, 0))
    forced = np.where(rng.random(B) < 0.3, np.minimum(rng.integers(0, K + 1, B), np.maximum(count - 1, 0)), -1)
    kept = np.asarray(accepted_drafts(tokens, first, count, drafts, forced.astype(np.int32)))
    for b in range(B):
        if count[b] and forced[b] < 0:
            n = count[b] - 1
            assert kept[b] == len(accept_draft_tokens(drafts[b, :n], tokens[first[b]:first[b] + n + 1])) - 1, b
        elif forced[b] >= 0:
            assert kept[b] == forced[b]
    # rows: two host rows (a prompt's) before each sequence's sampled ones
    lens = count + 2
    qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(qs[-1]) + 3
    at = (qs[:-1] + 2).astype(np.int32)
    host_ids = rng.integers(100, 200, T).astype(np.int32)
    slots = np.arange(T, dtype=np.int32)
    slots[qs[-1]:] = -1  # padding
    batch = Batch(host_ids, np.zeros(T, np.int32), slots, qs, lens.astype(np.int32), np.zeros((B, 1), np.int32), at)
    got = head_rows(batch, tokens, first, count, drafts, kept)
    ids, out_slots, last = map(np.asarray, (got.input_ids, got.slot_mapping, got.logits_indices))
    for b in range(B):
        lo = qs[b]
        assert (ids[lo:lo + 2] == host_ids[lo:lo + 2]).all() and (out_slots[lo:lo + 2] == slots[lo:lo + 2]).all()
        c = count[b]
        want = tokens[first[b]:first[b] + c].copy()  # the samples, but kept drafts (forced: maybe not the samples)
        want[:kept[b]] = drafts[b, :kept[b]] if c else want[:0]
        assert (ids[lo + 2:lo + 2 + c] == want).all(), b
        valid = kept[b] + 1 if c else 0
        assert (out_slots[lo + 2:lo + 2 + valid] == slots[lo + 2:lo + 2 + valid]).all()
        assert (out_slots[lo + 2 + valid:lo + 2 + c] == -1).all()
        assert last[b] == (lo + 2 + kept[b] if c else lo + 1)
    assert (out_slots[qs[-1]:] == -1).all()
