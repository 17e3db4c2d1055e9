"""EAGLE-3 drafts through the engine (jinfer/spec/eagle.py) on the tiny random Qwen3 and its random head
(tests/data/tiny-eagle3-qwen3): outputs equal those without speculation token for token (batch 1 and 4, prefix-cache
hits, chunked prefill, preemption), and the drafts the engine proposes after a prompt's prefill are the
reference head's greedy chain (tests/data/golden/tiny-eagle3-qwen3.npz), also when the prompt is prefilled in
chunks or partly comes from the prefix cache: the engine feeds the head what it was trained on. The random head
rarely agrees with the random target, so acceptance is near 0 here; the golden chain is what proves the wiring."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models import eagle3
from jinfer.models.batch import Batch
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA
from .test_spec_engine import assert_same, core, generate, spec_prompts

HEAD = DATA / "tiny-eagle3-qwen3"
EAGLE = {"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def plain():
    return core()


@pytest.fixture(scope="module")
def spec():
    return core(speculative_config=EAGLE)


@pytest.fixture(scope="module")
def small():
    """Chunked prefill (16-token steps) and a pool small enough to preempt."""
    return core(speculative_config=EAGLE, num_pages=26, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def golden():
    g = np.load(DATA / "golden" / "tiny-eagle3-qwen3.npz")
    n = sum(1 for k in g.files if k.startswith("prompt_"))
    return [(g[f"prompt_{i}"].tolist(), int(g[f"next_{i}"]), g[f"chain_ids_{i}"].tolist()) for i in range(n)]


def assert_drafted(counters: dict):
    assert counters["spec_decode_num_drafts"] > 0 and counters["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("batch", [4])  # mixed prompt lengths (batch 1: the golden-chain test's single requests)
def test_greedy_outputs_equal_without_speculation(plain, spec, batch):
    prompts = spec_prompts(batch, seed=batch)
    want, _ = generate(plain, prompts, GREEDY)
    got, counters = generate(spec, prompts, GREEDY)
    assert_same(got, want)
    assert_drafted(counters)
    again, _ = generate(spec, prompts, GREEDY)  # the prompts' pages now come from the prefix cache
    assert_same(again, want)


def test_device_drafts_with_penalties_seeds_and_min_tokens(plain, spec):
    """The head's drafts go to the next step as the device holds them (`request.device_input`), penalized rows'
    samplers read them there too: seeded, penalized and min_tokens requests give the tokens they give without
    drafts; and with every draft kept (forced: their ids become outputs and penalize the samples after them) the
    tokens they give with the drafts read back first."""
    from jinfer.spec.decoding import SpecDecoding
    from jinfer.spec.replay import ForcedAcceptance

    prompts = spec_prompts(4, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=0.5,
                             repetition_penalty=1.5),
              SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6, stop_token_ids=[200, 44, 214]),
              GREEDY]
    proposer, marked = spec.spec.proposer, []
    original = proposer.propose

    def propose(requests, *on_device):
        drafts = original(requests, *on_device)
        marked.extend(d[0] <= -2 for d in drafts if d)
        return drafts

    own, runs = spec.spec, {}
    proposer.propose = propose
    try:
        got, _ = generate(spec, prompts, params)
        for device in (True, False):
            proposer.device_drafts = device
            spec.spec = SpecDecoding(ForcedAcceptance(proposer, 1.0))
            runs[device], counters = generate(spec, prompts[:2], params[:2])
            assert counters["spec_decode_num_accepted_tokens"] > 0
    finally:
        spec.spec = own
        del proposer.propose, proposer.device_drafts
    assert_same(got, generate(plain, prompts, params)[0])
    assert_same(runs[True], runs[False])
    assert True in marked and False in marked  # (device drafts, and the drafts read back)


def first_drafts(engine, rid: str, prompt: list[int]) -> tuple[int, list[int]]:
    """Run one request to its end; (its first token, the drafts the engine proposed after it: their ids as its first
    verification checks them)."""
    spec, proposed = engine.spec, {}
    original = spec.accept

    def accept(request_id, drafts, sampled):
        if request_id == rid and drafts:
            proposed.setdefault(rid, list(drafts))
        return original(request_id, drafts, sampled)

    spec.accept = accept
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    tokens = []
    try:
        while engine.has_unfinished_requests():
            tokens += [t for d in engine.step() if d.request_id == rid for t in d.new_token_ids]
    finally:
        del spec.accept
    return tokens[0], proposed[rid]


@pytest.mark.parametrize("engine", ["spec", "small"])
def test_drafts_are_the_heads_golden_chain(engine, golden, request):
    """After a prompt's prefill (one step, or chunks of 16 tokens in `small`), the engine's drafts are the reference
    chain; again with the prompt's pages from the prefix cache (the hit one page short: that page's head KV is
    recomputed)."""
    eng = request.getfixturevalue(engine)
    for i, (prompt, nxt, chain) in enumerate(golden):
        for again in range(2):
            token, drafts = first_drafts(eng, f"golden-{engine}-{i}-{again}", prompt)
            assert (token, drafts) == (nxt, chain[:3]), (i, again)


def test_preemption_and_chunked_prefill(plain, small):
    """Chunked prefill, preemption, requests arriving every few steps and two aborted midway, penalized and min_tokens
    requests among greedy and seeded ones (steps launched before the read-back where every request allows, read back
    first while one does not): every request that ran to its end gives the tokens it gives without drafts, and the
    pool is whole after."""
    prompts = spec_prompts(8, seed=13)
    params = [GREEDY, SamplingParams(temperature=0.9, seed=5, max_tokens=14, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, presence_penalty=0.4),
              SamplingParams(temperature=0.7, seed=8, max_tokens=15, ignore_eos=True, min_tokens=9)] * 2
    want, _ = generate(plain, prompts, params)
    preempted, overlapped = [], small.spec.num_overlapped_steps
    original = small.scheduler._preempt
    small.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    got, step, waiting = {}, 0, list(enumerate(prompts))
    try:
        while waiting or small.has_unfinished_requests():
            if waiting and step % 3 == 0:
                i, p = waiting.pop(0)
                small.add_request(str(i), p, params[i])
            if step in (aborted := {9: "1", 24: "7"}):
                small.abort(aborted[step])
            for d in small.step():
                got[d.request_id] = got.get(d.request_id, []) + d.new_token_ids
            step += 1
    finally:
        small.scheduler._preempt = original
    assert {r: got[r] for r in got if r not in ("1", "7")} == {r.split("/")[0]: want[r][0] for r in want
                                                               if r.split("/")[0] not in ("1", "7")}
    assert len(got.get("1", [])) < 14 and len(got.get("7", [])) < 16  # (cut short)
    assert preempted and small.spec.num_overlapped_steps > overlapped
    assert small.kv.num_free_pages == small.kv.num_usable_pages


def test_device_drafts_no_step_took_are_dropped(spec):
    """Drafts handed over as the device holds them to a request the next step did not take (the budget ran out
    before it) are dropped once that step is launched: its head overwrites the rows they point at. Ids and the
    request's sampled token stay."""
    from jinfer.engine.request import DEVICE_TOKEN, Request, device_input

    proposer = spec.spec.proposer
    left, taken = (Request(rid, [5, 6, 7], GREEDY) for rid in ("left", "taken"))
    left.add_draft_tokens([device_input(i) for i in (100, 101, 102)])
    taken.pending_token_ids[:] = [11, DEVICE_TOKEN]  # (scheduled: its drafts have ids, its sample is in flight)
    proposer._handed = [left, taken]
    proposer._resolve([])
    assert left.pending_token_ids == [] and taken.pending_token_ids == [11, DEVICE_TOKEN] and proposer._handed == []


def test_executable_key_and_head_pages(plain, spec):
    """(The LLM API hands speculative_config to the engine as it is, whatever the method: test_spec_engine.py's
    test_offline_llm_api_with_speculative_config; the EAGLE-3 engine's outputs: the tests above.)"""
    # the target's forward returns the head's states: another program, another key in the executable cache
    assert spec.runner.aux_layers == (0, 1, 2) and plain.runner.aux_layers == ()
    assert spec.runner.executables.namespace != plain.runner.executables.namespace
    # the pool's pages hold the head's layer too
    assert spec.kv.hit_drop_last_page and not plain.kv.hit_drop_last_page


def test_bad_heads_are_refused(tmp_path):
    with pytest.raises(ValueError, match="speculative_config.model"):
        core(speculative_config=EAGLE | {"model": str(tmp_path / "missing")})
    shutil.copy(HEAD / "model.safetensors", tmp_path / "model.safetensors")
    raw = json.loads((HEAD / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"target_hidden_size": 32}))
    with pytest.raises(ValueError, match="speculative_config.model.*target_hidden_size=32"):
        core(speculative_config=EAGLE | {"model": str(tmp_path)})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        core(speculative_config={"method": "eagle3", "model": str(HEAD)})


def test_dummy_head_for_benchmarks_in_fp8():
    """speculative_config.model "dummy" (benchmarks: a head's device work at a target's shapes): a random head of the
    target's layer shapes with a 32000-token draft vocabulary (the tiny target's 256 here), d2t the identity, the
    target's embedding; with quantization "fp8" its projections and lm_head are block FP8 kept [out, in] (the decode
    kernels' layout); drafting through the engine keeps the tokens of decoding without it."""
    from jinfer.models.fp8 import is_fp8

    engine = core(speculative_config=EAGLE | {"model": "dummy", "quantization": "fp8"})
    head = engine.spec.proposer
    assert head.cfg.layer.hidden_size == engine.model_config.hidden_size and head.cfg.draft_vocab_size == 256
    w = head.weights
    assert all(is_fp8(x) and x.transposed for x in (w.fc, w.wqkv, w.wo, w.w_gate, w.w_up, w.w_down, w.lm_head))
    np.testing.assert_array_equal(head.weights.embed, engine.runner.weights.embed)
    np.testing.assert_array_equal(head.weights.draft_to_target, np.arange(256))
    prompts = spec_prompts(2, seed=1)
    got, counters = generate(engine, prompts, GREEDY)
    assert_same(got, generate(core(), prompts, GREEDY)[0])
    assert_drafted(counters)


def test_chain_writes_only_allocated_pages():
    """A chain step's KV write at a position whose page-table entry is unallocated (the reserved page 0) or past the
    table, or of a sequence that is not live, goes nowhere (never into another sequence's page)."""
    table = np.array([[3, 5, 0], [7, 0, 0], [2, 4, 6]], np.int32)
    batch = Batch(np.zeros(3, np.int32), np.zeros(3, np.int32), np.zeros(3, np.int32), np.arange(4, dtype=np.int32),
                  np.ones(3, np.int32), table, np.arange(3, dtype=np.int32))
    positions = jnp.array([5, 4, 13])  # page 1 of seq 0 (5), page 1 of seq 1 (unallocated), past seq 2's table
    step = eagle3.chain_batch(batch, jnp.zeros(3, jnp.int32), positions, 4)
    np.testing.assert_array_equal(step.slot_mapping, [5 * 4 + 1, -1, -1])
    live = eagle3.chain_batch(batch, jnp.zeros(3, jnp.int32), jnp.array([5, 0, 1]), 4, jnp.array([False, True, True]))
    np.testing.assert_array_equal(live.slot_mapping, [-1, 7 * 4, 2 * 4 + 1])


def test_next_step_launched_before_the_read_back(plain, spec):
    """With a step in flight whose drafts are the device's, the next step is launched before it is read back, its rows
    built as if every draft is kept and moved back on the device by those rejected (positions, KV slots, lengths, the
    first input, the sampler's output index): greedy and seeded sampling give the tokens they give without drafts
    (nearly every draft rejected here), and forced outcomes (every draft kept; some kept, then a rejection) the tokens
    they give with every step read back first, up to the last 2 (k + 1) tokens (there the drafts that fit max_tokens
    are counted as if those in flight are kept: fewer are drafted, and forced outcomes keep other tokens)."""
    from jinfer.spec.decoding import SpecDecoding
    from jinfer.spec.replay import ForcedAcceptance

    prompts = spec_prompts(4, seed=5)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=9, max_tokens=12, ignore_eos=True)] * 2
    overlapped = spec.spec.num_overlapped_steps
    assert_same(generate(spec, prompts, params)[0], generate(plain, prompts, params)[0])
    assert spec.spec.num_overlapped_steps > overlapped
    own, runs, n = spec.spec, {}, 24
    try:
        for p in (1.0, 0.6):
            for overlap in (True, False):
                spec._overlap = overlap
                spec.spec = SpecDecoding(ForcedAcceptance(own.proposer, p))
                runs[p, overlap], counters = generate(spec, prompts, SamplingParams(temperature=0.0, max_tokens=n,
                                                                                    ignore_eos=True))
                assert 0 < counters["spec_decode_num_accepted_tokens"]
                assert (spec.spec.num_overlapped_steps > 0) == overlap
            cut = n - 2 * (own.k + 1)
            first = {overlap: {r: v[0][:cut] for r, v in runs[p, overlap].items()} for overlap in (True, False)}
            assert first[True] == first[False]
    finally:
        spec.spec, spec._overlap = own, True
