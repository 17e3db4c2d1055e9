"""Speculative decoding (n-gram drafts) through the engine on the tiny random Qwen3 (tests/data/tiny-qwen3) with a
byte-level tokenizer: every output equals the output without speculation, token for token (greedy and seeded
sampling, logprobs, stop tokens and stop strings inside accepted drafts, min_tokens, penalties, n > 1, grammars,
preemption, chunked prefill, prefix caching, tensor parallel; the MoE family: tests/models/test_moe_engine.py),
drafts are both accepted and rejected (the counters say so), and the real SmolLM2 weights accept drafts on a prompt
that repeats itself. The tiny random models' greedy outputs fall into loops, which n-gram drafts predict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.engine.step_inputs import batch_sizes
from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams
from jinfer.structured_outputs import StructuredOutputsParams

from ..conftest import DATA
from .test_engine import BASE, lowerings, run_all
from .test_structured_engine import byte_tokenizer

TINY = str(DATA / "tiny-qwen3")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def spec_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths; most repeat a short phrase (drafts found in the prompt), some do not."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(3, 250, size=int(rng.integers(2, 6))).tolist()
        tail = rng.integers(3, 250, size=int(rng.integers(1, 20))).tolist()
        out.append(tail if i % 4 == 3 else tail + phrase * int(rng.integers(2, 5)))
    return out


def core(model: str = TINY, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model, **{**BASE, **kw}), tokenizer=byte_tokenizer())


@pytest.fixture(scope="module")
def plain():
    return core()


@pytest.fixture(scope="module")
def spec():
    return core(speculative_config=NGRAM)


def generate(engine: EngineCore, prompts, params) -> tuple[dict, dict]:
    """request id -> (token ids, text, finish reason, stop reason, logprobs), and the spec counters' increase."""
    before = engine.stats()
    texts, results = {}, {}
    reqs = [(str(i), p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    for rid, prompt, sp in reqs:
        engine.add_request(rid, prompt, sp)
    while engine.has_unfinished_requests():
        for d in engine.step():
            key = f"{d.request_id}/{d.index}"
            ids, text, lps, _, _ = results.get(key, ([], "", [], None, None))
            results[key] = (ids + d.new_token_ids, text + d.new_text, lps + (d.new_logprobs or []),
                            d.finish_reason, d.stop_reason)
            texts[key] = results[key][1]
    after = engine.stats()
    counters = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("spec_decode")}
    return results, counters


def assert_same(a: dict, b: dict, logprobs: bool = False):
    assert a.keys() == b.keys()
    for key in a:
        (ids_a, text_a, lps_a, fr_a, sr_a), (ids_b, text_b, lps_b, fr_b, sr_b) = a[key], b[key]
        assert (ids_a, text_a, fr_a, sr_a) == (ids_b, text_b, fr_b, sr_b), key
        if logprobs and (lps_a or lps_b):
            assert len(lps_a) == len(lps_b) == len(ids_a)
            for x, y in zip(lps_a, lps_b):
                assert x.keys() == y.keys()
                np.testing.assert_allclose([x[t] for t in x], [y[t] for t in x], atol=1e-4)


def assert_drafts_accepted_and_rejected(counters: dict):
    assert counters["spec_decode_num_drafts"] > 0
    assert 0 < counters["spec_decode_num_accepted_tokens"] < counters["spec_decode_num_draft_tokens"]
    per_pos = [counters[f"spec_decode_num_accepted_tokens_per_pos_{i}"] for i in range(3)]
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == counters["spec_decode_num_accepted_tokens"]


def test_greedy_outputs_equal_without_speculation(plain, spec):
    """A batch of 8, the same again from the prefix cache, then one request alone (through test_engine's run_all:
    deltas simply carry several tokens). (One batch size: the lone request covers the batch of one.)"""
    prompts = spec_prompts(8, seed=8)
    want, _ = generate(plain, prompts, GREEDY)
    got, counters = generate(spec, prompts, GREEDY)
    assert_same(got, want)
    assert_drafts_accepted_and_rejected(counters)
    again, _ = generate(spec, prompts, GREEDY)  # the prompts' pages now come from the prefix cache
    assert_same(again, want)
    out, finish = run_all(spec, [("x", prompts[0], GREEDY)])
    assert out["x/0"] == want["0/0"][0] and len(out["x/0"]) == 24 and finish["x/0"] == "length"


def test_offline_llm_api_with_speculative_config(plain):
    prompts = spec_prompts(6, seed=11)
    want, _ = generate(plain, prompts, GREEDY)
    llm = LLM(TINY, **BASE, speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want[f"{i}/0"][0] for i in range(len(prompts))]
    lengths = [o.metrics.mean_acceptance_length for o in outs]
    assert all(x is None or x >= 1 for x in lengths) and max(x or 0 for x in lengths) > 1
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(TINY, **BASE, speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="MTP layer of Qwen3.5"):
        LLM(TINY, **BASE, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_seeded_sampling_logprobs_penalties_min_tokens_and_n(plain, spec):
    prompts = spec_prompts(6, seed=3)
    # (10 tokens: the penalized row's output-length bucket, part of the sampler's shape, grows 1, 2, 4, 8, 16 and each
    # is compiled in both engines)
    params = [SamplingParams(temperature=0.7, seed=7, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=1.0, seed=1, max_tokens=10, ignore_eos=True, n=3),
              SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, frequency_penalty=0.2,
                             repetition_penalty=1.1),
              SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5, stop_token_ids=[200, 44, 214]),
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True, logprobs=1)]
    want, _ = generate(plain, prompts, params)
    got, counters = generate(spec, prompts, params)
    assert_same(got, want, logprobs=True)
    assert counters["spec_decode_num_accepted_tokens"] > 0


def test_stop_tokens_and_stop_strings_inside_accepted_drafts(plain, spec):
    prompts = spec_prompts(8, seed=5)
    free, _ = generate(plain, prompts, GREEDY)
    params = []
    for i in range(len(prompts)):  # stop on a token / a text that first appears mid-output
        ids, text = free[f"{i}/0"][:2]
        j = next((j for j in range(4, len(ids)) if ids[j] not in ids[:j]), None)
        if i % 2 and j is not None:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ids[j]]))
        else:
            k = next((k for k in range(4, len(text) - 1) if text.find(text[k:k + 2]) == k), None)
            stop = [text[k:k + 2]] if k is not None else None
            params.append(SamplingParams(temperature=0.0, max_tokens=24, stop=stop, ignore_eos=True,
                                         include_stop_str_in_output=i % 4 == 0))
    want, _ = generate(plain, prompts, params)
    got, counters = generate(spec, prompts, params)
    assert_same(got, want)
    assert sum(r[3] == "stop" for r in want.values()) >= 6
    assert counters["spec_decode_num_accepted_tokens"] > 0


def test_grammar_constrains_every_drafted_position(plain, spec):
    so = StructuredOutputsParams(regex="[a-c]{30}")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    prompts = spec_prompts(3, seed=8)
    want, _ = generate(plain, prompts, params)
    got, counters = generate(spec, prompts, params)
    assert_same(got, want)
    assert all(len(text) == 30 and set(text) <= set("abc") for _, text, *_ in got.values())
    assert counters["spec_decode_num_accepted_tokens"] > 0


def test_preemption_and_chunked_prefill(plain):
    """... and nothing compiles after warm-up: steps with more logits rows than sequences (drafts beside a prefill
    chunk, verify steps) have their forwards and samplers made ready too."""
    prompts = spec_prompts(8, seed=13)
    want, _ = generate(plain, prompts, GREEDY)
    small = core(speculative_config=NGRAM, num_pages=26, max_num_batched_tokens=16, max_num_seqs=4, warmup=True)
    preempted = []
    original = small.scheduler._preempt
    small.scheduler._preempt = lambda r: (preempted.append(r.request_id), original(r))
    with lowerings() as lowered:
        got, counters = generate(small, prompts, GREEDY)
    assert_same(got, want)
    assert preempted and counters["spec_decode_num_accepted_tokens"] > 0
    assert lowered == [] and small.stats()["compiles_after_warmup"] == 0, lowered


def test_verify_steps_take_the_paged_decode_kernel(plain):
    """Pallas kernels (interpreted): the steps whose sequences have at most 1 + k new tokens each (verifying drafts)
    run the verify executable, whose attention is the paged decode kernel with 1 + k query rows a sequence, not the
    ragged prefill kernel; the greedy tokens equal the reference engine's without drafts."""
    prompts = spec_prompts(4, seed=8)
    want, _ = generate(plain, prompts, GREEDY)
    engine = core(speculative_config=NGRAM, attention_backend="pallas", max_num_seqs=4, max_num_batched_tokens=16)
    runner = engine.runner
    assert runner.verify_len == 4 and runner.verify_buckets == {8, 16}
    kinds = []  # per launch: the forward's kind (0 any step, 4 verify)
    run_forward = runner.run_forward
    runner.run_forward = lambda T, B, P, kind, *a: (kinds.append(kind), run_forward(T, B, P, kind, *a))[1]
    got, counters = generate(engine, prompts, GREEDY)
    assert_same(got, want)
    assert_drafts_accepted_and_rejected(counters)
    assert kinds.count(4) >= 5 and 0 in kinds  # (prefills: the ragged kernel)
    P = runner.page_buckets[-1]
    buf = jax.ShapeDtypeStruct((sum(batch_sizes(8, 4, P, 8)),), jnp.int32)
    outs = tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in runner.outputs_kept(8, 8))
    jaxpr = str(jax.make_jaxpr(runner.forward_executable(8, 4, P, 4))(runner.weight_leaves, buf, runner.kv_cache,
                                                                       runner._prev_spec, outs))
    assert "paged_decode_attention_ppb" in jaxpr and "_q4" in jaxpr and "ragged_prefill_attention" not in jaxpr


@pytest.mark.slow
def test_tensor_parallel(plain):
    """Tensor parallel 2 with drafts gives the one-device engine's tokens (the MoE family with drafts:
    tests/models/test_moe_engine.py, against HF's ids)."""
    prompts = spec_prompts(4, seed=21)
    want, _ = generate(plain, prompts, GREEDY)
    got, counters = generate(core(tensor_parallel_size=2, speculative_config=NGRAM), prompts, GREEDY)
    assert_same(got, want)
    assert counters["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_smollm2_accepts_drafts_on_a_repeating_prompt(default_gguf):
    llm = LLM(str(default_gguf), dtype="float32", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=128,
              warmup=False, compilation_cache_dir="", speculative_config=NGRAM)
    text = "The quick brown fox jumps over the lazy dog. " * 4
    out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    assert out.metrics.spec_num_accepted_tokens > 0 and out.outputs[0].text


def test_replay_drafter_in_the_engine():
    """The replay drafter in forced mode (benchmarks) decides acceptance: the engine's mean acceptance length is near
    1 + p + p^2 + p^3, and every request still gets its max_tokens tokens."""
    from jinfer.spec.replay import ReplayProposer

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = EngineCore(EngineConfig(TINY, **BASE), proposer=ReplayProposer(3, acceptance=0.7, forced=True))
    got, counters = generate(engine, spec_prompts(4, seed=41), params)
    assert all(len(ids) == 40 for ids, *_ in got.values())
    mean = 1 + counters["spec_decode_num_accepted_tokens"] / counters["spec_decode_num_drafts"]
    assert abs(mean - (1 + 0.7 + 0.49 + 0.343)) < 0.35, mean
