"""Multi-token steps: a sequence computes its last token and the draft tokens it verifies in one row and gets a
logits row (a sample) at each of those positions. Through the real scheduler and runner (tiny Qwen3, reference
ops, CPU), against HF transformers' own logits (tests/data/golden, scripts/make_golden.py): every position's
full distribution, taken from the sampler's logprobs over the whole vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.cache.manager import KVCacheManager
from jinfer.engine.request import DEVICE_TOKEN, Request, accept_draft_tokens
from jinfer.engine.runner import ModelRunner, StepRow
from jinfer.engine.scheduler import Scheduler, SchedulerConfig
from jinfer.models.registry import shard_weights
from jinfer.parallel.mesh import make_mesh
from jinfer.sampling_params import SamplingParams
from jinfer.weights.loader import load_weights, resolve_model

from ..conftest import DATA

PAGE = 4
ATOL = 2e-4  # float32 against PyTorch float32: summation-order noise
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()


@pytest.fixture(scope="module")
def model():
    src = resolve_model(DATA / "tiny-qwen3")
    mesh = make_mesh(1, jax.devices()[:1])
    weights = shard_weights(src.config, load_weights(src, "float32", mesh, progress=False), mesh)
    gold = np.load(DATA / "golden" / "tiny-qwen3.npz")
    return src.config, weights, mesh, gold


def engine(model, max_num_seqs=2):
    """A scheduler and a runner as the engine core builds them. Two sequences at most: a step with a 3-token
    verification row and a prefill returns 4 logits rows, more than its 2 sequences (R = T rows)."""
    cfg, weights, mesh, _ = model
    kv = KVCacheManager(64, PAGE, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_model_len=96, max_num_seqs=max_num_seqs, max_num_batched_tokens=32), kv)
    runner = ModelRunner(cfg, weights, mesh, num_pages=64, page_size=PAGE, kv_dtype=jnp.float32,
                         max_num_batched_tokens=32, max_num_seqs=max_num_seqs, max_model_len=96)
    return sched, runner


def run(sched, runner, max_tokens=None):
    """One synchronous step, every sequence greedy with the logprobs of the whole vocabulary: (out, result)."""
    out = sched.schedule(max_tokens)
    rows = [StepRow(GREEDY, s.request.output_token_ids, None, 0,
                    s.request.num_output_tokens + s.request.num_pending_tokens - 1) if s.needs_sample else None
            for s in out.scheduled]
    result = runner.fetch(runner.launch(out, rows, runner.cfg.vocab_size))
    return out, result


def distribution(result, row):
    """The full logprob vector of one logits row, from its top-V logprobs."""
    lp = np.full(result.top_ids.shape[1], -np.inf)
    lp[result.top_ids[row]] = result.top_logprobs[row]
    return lp


def check_rows(result, rid, gold_logits, num_rows=None):
    """The sequence's logits rows (`num_rows` of them; the first len(gold_logits) checked) are HF's."""
    rows = result.rows_of(rid)
    assert len(rows) == (num_rows or len(gold_logits))
    for row, logits in zip(rows, gold_logits):
        np.testing.assert_allclose(distribution(result, row), log_softmax(logits), atol=ATOL, rtol=1e-4)
    assert result.tokens_of(rid)[:len(gold_logits)] == [int(np.argmax(g)) for g in gold_logits]


def test_three_token_decode_rows_give_the_reference_logits_at_every_position(model):
    """Sequence a holds prompt 1 + its first 2 greedy tokens, computed but its last one; with 2 drafts (HF's next
    greedy tokens) its decode row is 3 tokens, scheduled beside sequence b's prefill. Every position's logits are
    HF's (`decode_logits_1[s]` chose greedy token s, at full-sequence position len(prompt) - 1 + s)."""
    *_, gold = model
    prompt, greedy = gold["prompt_1"].tolist(), gold["greedy_1"].tolist()
    full, m = prompt + greedy, len(prompt) + 2
    sched, runner = engine(model)
    a, b = Request("a", full[:m], GREEDY), Request("b", gold["prompt_0"].tolist(), GREEDY)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = run(sched, runner, max_tokens=m - 1)  # a's first m - 1 tokens (no sample): b waits
    assert [(s.request_id, s.num_new_tokens, s.num_logits) for s in out.scheduled] == [("a", m - 1, 0)]
    sched.update(out, {})
    a.add_draft_tokens(full[m:m + 2])
    out, result = run(sched, runner)
    assert [(s.request_id, s.start, s.num_new_tokens, s.num_logits, s.draft_token_ids) for s in out.scheduled] == \
        [("a", m - 1, 3, 3, full[m:m + 2]), ("b", 0, len(gold["prompt_0"]), 1, [])]
    assert a.pending_token_ids == [*full[m:m + 2], DEVICE_TOKEN]
    assert result.rows == {"a": (0, 3), "b": (3, 1)} and len(result.tokens) == 8  # R = T = 8 > B = 2
    check_rows(result, "a", gold["decode_logits_1"][2:5])
    check_rows(result, "b", gold["prefill_logits_0"][-1:])
    accepted = {s.request_id: accept_draft_tokens(s.draft_token_ids, result.tokens_of(s.request_id))
                for s in out.scheduled}
    assert accepted["a"] == greedy[2:5]  # both drafts and the bonus token
    sched.update(out, accepted)
    assert a.output_token_ids == greedy[2:5] and a.num_computed_tokens == a.num_tokens - 1 == m + 2
    assert not a.pending_token_ids and b.output_token_ids == greedy_of(gold, 0)[:1]
    out, result = run(sched, runner)  # plain decodes from there on
    check_rows(result, "a", gold["decode_logits_1"][5:6])
    check_rows(result, "b", gold["decode_logits_0"][1:2])


def greedy_of(gold, i):
    return gold[f"greedy_{i}"].tolist()


def test_rejected_drafts_roll_back_and_their_kv_is_recomputed(model):
    """The second draft is wrong: the first is accepted with the token sampled after it, the sequence rolls back
    over the wrong one, and the next steps' logits (which overwrite its KV slot) are HF's again."""
    *_, gold = model
    prompt, greedy = gold["prompt_1"].tolist(), gold["greedy_1"].tolist()
    full, m = prompt + greedy, len(prompt) + 2
    wrong = (full[m + 1] + 1) % 256
    sched, runner = engine(model)
    a = Request("a", full[:m], GREEDY)
    sched.add_request(a)
    out, _ = run(sched, runner, max_tokens=m - 1)
    sched.update(out, {})
    a.add_draft_tokens([full[m], wrong])
    out, result = run(sched, runner)
    check_rows(result, "a", gold["decode_logits_1"][2:4], num_rows=3)  # the row after the wrong draft: not HF's
    samples = result.tokens_of("a")
    accepted = accept_draft_tokens(out.scheduled[0].draft_token_ids, samples)
    assert accepted == greedy[2:4] and len(samples) == 3
    sched.update(out, {"a": accepted})
    assert a.num_computed_tokens == a.num_tokens - 1 == m + 1
    for s in (4, 5):
        out, result = run(sched, runner)
        assert [(x.start, x.num_new_tokens) for x in out.scheduled] == [(len(prompt) - 1 + s, 1)]
        check_rows(result, "a", gold["decode_logits_1"][s:s + 1])
        sched.update(out, {"a": result.tokens_of("a")})
    assert a.output_token_ids == greedy[2:6]


# ---- the scheduler alone -----------------------------------------------------------------------------------------


def scheduler(num_pages=64, **cfg):
    kv = KVCacheManager(num_pages, PAGE, enable_prefix_caching=False)
    return Scheduler(SchedulerConfig(max_model_len=cfg.pop("max_model_len", 64), **cfg), kv)


def test_drafts_that_do_not_fit_the_budget_or_the_length_are_dropped():
    sched = scheduler(max_num_batched_tokens=8)
    a = Request("a", list(range(10, 16)), SamplingParams(max_tokens=4))
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, {"a": [7]})  # 7 tokens, the last not computed
    a.add_draft_tokens([1, 2, 3, 4, 5])
    out = sched.schedule()  # max_tokens 4: 1 output, at most 2 drafts (the 4th token is sampled after them)
    assert [(s.num_new_tokens, s.num_logits, s.draft_token_ids) for s in out.scheduled] == [(3, 3, [1, 2])]
    sched.update(out, {"a": [1, 2, 9]})
    assert a.output_token_ids == [7, 1, 2, 9] and a.is_finished  # length: max_tokens
    b = Request("b", list(range(20, 26)), SamplingParams(max_tokens=30))
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, {"b": [7]})
    b.add_draft_tokens(list(range(1, 12)))
    out = sched.schedule()  # the budget of 8 tokens: the last token and 7 drafts
    assert [(s.num_new_tokens, s.num_logits) for s in out.scheduled] == [(8, 8)]
    sched.update(out, {"b": [1, 2, 3, 40]})  # 3 drafts accepted, then 40 for the 4th: 4 drafts rejected
    assert b.output_token_ids == [7, 1, 2, 3, 40] and b.num_computed_tokens == b.num_tokens - 1


def test_a_stop_among_accepted_tokens_drops_the_rest_and_preemption_drops_drafts():
    sched = scheduler()
    a = Request("a", list(range(10, 14)), SamplingParams(max_tokens=20), eos_token_ids=(2,))
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, {"a": [7]})
    a.add_draft_tokens([1, 2, 3])
    out = sched.schedule()
    assert sched.update(out, {"a": [1, 2, 3]}) == [a] and a.output_token_ids == [7, 1, 2]  # EOS ends it
    b = Request("b", [5, 6], SamplingParams(max_tokens=20))
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, {"b": [7]})
    b.add_draft_tokens([1, 2, 3])
    with pytest.raises(ValueError, match="1 to 4"):
        sched.update(sched.schedule(), {"b": [1, 2, 3, 4, 5]})
    sched = scheduler()
    c = Request("c", [8, 9], SamplingParams(max_tokens=20))
    sched.add_request(c)
    sched.schedule()  # its prefill samples a token, in flight
    c.add_draft_tokens([4])
    sched.running.remove(c)
    sched._preempt(c)
    assert c.pending_token_ids == [DEVICE_TOKEN]  # the sample in flight stays; no uncovered draft is left behind
