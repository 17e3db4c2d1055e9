"""The tiny Qwen3.5 checkpoint through the whole engine (scheduler, paged KV for the attention layer, a
state slot per sequence for the Gated DeltaNet layers, chunked prefill, preemption, n > 1, async
scheduling, warm-up buckets) against HF's greedy ids."""

import logging

import numpy as np
import pytest

from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA

TINY = str(DATA / "tiny-qwen3_5")
GOLD = np.load(DATA / "golden" / "tiny-qwen3_5.npz")
PROMPTS = [GOLD[f"prompt_{i}"].tolist() for i in range(3)]  # 5, 37 and 80 tokens
GREEDY_IDS = [GOLD[f"greedy_{i}"].tolist() for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
BASE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_seqs=8, compilation_cache_dir="")


def generate(llm, params=GREEDY, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("budget", [7, 24])
def test_engine_greedy_matches_hf_with_chunked_prefill(budget, caplog):
    """7-token steps: chunks of 1-7 rows next to the other sequences' decodes, cutting the conv window
    (3 rows); 24: chunks cut through HF's 64-row delta-rule chunk."""
    with caplog.at_level(logging.INFO, logger="jinfer.engine.core"):
        llm = LLM(TINY, **BASE, max_num_batched_tokens=budget, warmup=False)
    assert "prefix caching is off" in caplog.text and not llm.engine.kv.enable_prefix_caching
    assert [o[0] for o in generate(llm)] == GREEDY_IDS
    kv = llm.engine.kv
    assert kv.num_free_state_slots == kv.num_state_slots - 1 and kv.num_free_pages == kv.num_usable_pages


def test_preemption_recomputes_the_state():
    """A pool too small for all three: the newest is preempted, loses its slot and recomputes its state
    from position 0 (its slot may meanwhile hold another sequence's state)."""
    llm = LLM(TINY, **BASE, max_num_batched_tokens=32, num_pages=33, warmup=False)
    sched = llm.engine.scheduler
    preempted = []
    original = sched._preempt
    sched._preempt = lambda r: (preempted.append(r.request_id), original(r))
    assert [o[0] for o in generate(llm)] == GREEDY_IDS
    assert preempted


def test_n_samples_and_sync_scheduling():
    """n = 2 greedy samples of each prompt (each sample its own sequence and state slot), without async
    scheduling."""
    llm = LLM(TINY, **BASE, max_num_batched_tokens=32, warmup=False, async_scheduling=False)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=32, ignore_eos=True)
    assert generate(llm, params) == [[g, g] for g in GREEDY_IDS]


def test_pallas_backend_warm_buckets_and_async():
    """Pallas kernels (interpreted on CPU), every bucket compiled at warm-up: no compile while serving."""
    llm = LLM(TINY, **BASE, max_num_batched_tokens=16, attention_backend="pallas")
    assert [o[0] for o in generate(llm)] == GREEDY_IDS
    assert llm.engine.runner.compiles_after_warmup == 0


def test_pallas_backend_long_prefill_runs_chunked():
    """A 128-token budget: the 80-token prompt prefills in one step beside the others, so its Gated DeltaNet
    layers run the chunked kernel (>= 64 new rows) while the short prompts and the decodes run the
    recurrent one."""
    llm = LLM(TINY, **BASE, max_num_batched_tokens=128, attention_backend="pallas", warmup=False)
    assert [o[0] for o in generate(llm)] == GREEDY_IDS


def test_pallas_decode_only_steps_take_the_fused_decode_kernel():
    """max_num_seqs = max_num_batched_tokens = 16: steps where every sequence decodes run the bucket's
    decode-only executable, whose Gated DeltaNet layers are the fused decode kernel (13 of its 16 rows
    padding, on the reserved slot 0); the greedy ids are still HF's."""
    llm = LLM(TINY, **(BASE | {"max_num_seqs": 16}), max_num_batched_tokens=16, attention_backend="pallas",
              warmup=False)
    runner = llm.engine.runner
    assert 16 in runner.decode_buckets
    assert [o[0] for o in generate(llm)] == GREEDY_IDS
    assert any(key[0] == "forward_decode" for key in runner._compiled)
