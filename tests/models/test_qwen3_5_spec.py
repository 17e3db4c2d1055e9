"""Speculative decoding on the tiny Qwen3.5 (Gated DeltaNet layers with a state per sequence, one attention layer):
a verifying row reads one slot of its pair, writes the state after the whole row to the other and the state after its
known tokens to the first, so a rejection goes on from its first draft and recomputes the drafts it kept
(jinfer/engine/scheduler.py). Greedy outputs equal HF's
and the engine's without drafts, token for token, at batch 1 and 4, with n-gram drafts and with a replay drafter
that forces rejections, under preemption, and with n > 1 samples forked from one prefill."""

import numpy as np
import pytest

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.sampling_params import SamplingParams
from jinfer.spec.replay import ReplayProposer

from ..conftest import DATA

pytestmark = pytest.mark.slow  # whole engines

TINY = str(DATA / "tiny-qwen3_5")
GOLD = np.load(DATA / "golden" / "tiny-qwen3_5.npz")
PROMPTS = [GOLD[f"prompt_{i}"].tolist() for i in range(3)]  # 5, 37 and 80 tokens
GREEDY_IDS = [GOLD[f"greedy_{i}"].tolist() for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
BASE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
            compilation_cache_dir="", warmup=False)
# Room for 32 pages of 4 tokens: too few for the golden prompts' 28 + 18 + 10 pages at once, so requests are preempted.
# Every speculating engine here has this pool: one KV shape, so the later engines load the first one's executables.
SMALL_POOL = 33
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# a prompt whose phrase repeats (n-gram drafts found in it), next to the golden ones
REPEAT = [7, 19, 44, 101] * 4


def run(engine: EngineCore, prompts, params=GREEDY) -> tuple[list[list[list[int]]], dict]:
    """Each prompt's samples' token ids, and the spec counters' increase."""
    before = engine.stats()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            got.setdefault(f"{d.request_id}/{d.index}", []).extend(d.new_token_ids)
    after = engine.stats()
    out = [[got[f"{i}/{j}"] for j in range(params.n)] for i in range(len(prompts))]
    return out, {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("spec_decode")}


@pytest.fixture(scope="module")
def plain_repeat():
    return run(EngineCore(EngineConfig(TINY, **BASE)), [REPEAT])[0][0][0]


@pytest.fixture(scope="module")
def ngram():
    return EngineCore(EngineConfig(TINY, **BASE, num_pages=SMALL_POOL, speculative_config=NGRAM))


def assert_slots_free(engine: EngineCore):
    kv = engine.kv
    assert kv.num_free_state_slots == kv.num_state_slots - 1 and kv.num_free_pages == kv.num_usable_pages


@pytest.mark.parametrize("batch", [4])  # (the repeating prompt and three of mixed lengths)
def test_ngram_greedy_equals_without_speculation(ngram, plain_repeat, batch):
    prompts = ([REPEAT] + PROMPTS)[:batch]
    want = ([plain_repeat] + GREEDY_IDS)[:batch]
    got, counters = run(ngram, prompts)
    assert [g[0] for g in got] == want
    assert counters["spec_decode_num_drafts"] > 0
    assert counters["spec_decode_num_accepted_tokens"] < counters["spec_decode_num_draft_tokens"]  # rejections
    assert ngram.kv.state_pairs and ngram.kv.num_device_state_slots == 2 * ngram.kv.num_state_slots - 1
    assert_slots_free(ngram)


def replay_engine(acceptance: float, **kw) -> EngineCore:
    proposer = ReplayProposer(3, acceptance=acceptance, seed=3)
    for p, ids in zip(PROMPTS, GREEDY_IDS):
        proposer.record(p, ids)
    return EngineCore(EngineConfig(TINY, **(BASE | {"num_pages": SMALL_POOL} | kw)), proposer=proposer)


def test_replay_drafts_accepted_and_rejected_with_preemption():
    """Forced rejections (acceptance 0.6) at batch 3 with mixed prompt lengths, in a pool too small for all three:
    requests are preempted (their slots freed) and still give HF's ids; rows that recompute accepted tokens verify new
    drafts too. A verifying row writes the other slot of its request's pair, which is the request's after it where
    every draft was kept: no state is copied."""
    engine = replay_engine(0.6)
    sched = engine.scheduler
    preempted, original, schedule, known, moved = [], sched._preempt, sched.schedule, [], []
    sched._preempt = lambda r: (preempted.append(r.request_id), original(r))

    def counting(*args, **kw):  # the known tokens of each row that verifies drafts; its slots
        out = schedule(*args, **kw)
        known.extend(s.num_new_tokens - len(s.draft_token_ids) for s in out.scheduled if s.draft_token_ids)
        assert not out.fork_slots
        for s in out.scheduled:
            assert (s.state_write_slot == engine.kv.other_slot(s.state_slot)) == bool(s.draft_token_ids), s
            moved.append(s.state_slot >= engine.kv.num_state_slots)
        return out

    sched.schedule = counting
    got, counters = run(engine, PROMPTS)
    assert [g[0] for g in got] == GREEDY_IDS
    assert preempted
    # a row rolled back over a rejected draft recomputes its accepted tokens and verifies new drafts in one step
    assert max(known) > 1
    assert 0 < counters["spec_decode_num_accepted_tokens"] < counters["spec_decode_num_draft_tokens"]
    assert any(moved) and not all(moved)  # states in the second slots of their pairs, and in the first
    assert_slots_free(engine)


def test_n_samples_fork_with_drafts():
    """n = 2 greedy samples forked from one prefill, each verifying replayed drafts (some accepted, some rejected):
    every sample equals HF's ids."""
    engine = replay_engine(0.5)  # (the n-gram engine's shapes: its executables loaded, not compiled)
    forks, original = [], engine.runner.fork
    engine.runner.fork = lambda pages, slots: (forks.append(list(slots)), original(pages, slots))
    got, counters = run(engine, PROMPTS, SamplingParams(n=2, temperature=0.0, max_tokens=32, ignore_eos=True))
    assert got == [[g] * 2 for g in GREEDY_IDS]
    assert forks and 0 < counters["spec_decode_num_accepted_tokens"] < counters["spec_decode_num_draft_tokens"]
    assert_slots_free(engine)
