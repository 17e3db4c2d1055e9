"""The tiny Qwen3-MoE checkpoint through the whole engine (scheduler, paged KV, chunked prefill, prefix
cache, async scheduling, decode-only executables, n-gram speculative decoding) against HF's greedy ids."""

import numpy as np
import pytest

from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA
from ..unit.test_spec_engine import NGRAM

pytestmark = pytest.mark.slow  # whole engines, each built and compiled for its own configuration

TINY = str(DATA / "tiny-qwen3_moe")
GOLD = np.load(DATA / "golden" / "tiny-qwen3_moe.npz")
PROMPTS = [GOLD[f"prompt_{i}"].tolist() for i in range(3)]
GREEDY_IDS = [GOLD[f"greedy_{i}"].tolist() for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
# 16-token steps: the 37-token prompt is prefilled in chunks next to the others' decodes
BASE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8,
            compilation_cache_dir="")


@pytest.mark.parametrize("backend", ["reference", "pallas"])
def test_engine_greedy_matches_hf(backend):
    """Pallas: the routing kernel and the grouped GEMMs in the Pallas interpreter. (No warm-up here: the MoE Pallas
    engine's warm-up and no compile after it are test_parallel_engine.py's qwen3_moe ep4 pallas case; the prefix
    cache's pages are the same on either backend, checked once on the reference.)"""
    llm = LLM(TINY, **BASE, attention_backend=backend, warmup=False)
    core = llm.engine
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == GREEDY_IDS
    if backend == "reference":  # the same prompts again: served from the prefix cache, same tokens
        hits = core.kv.num_hit_tokens
        again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[::-1]], GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in again] == GREEDY_IDS[::-1]
        assert core.kv.num_hit_tokens > hits
    assert core.kv.num_free_pages == core.kv.num_usable_pages


def test_speculative_decoding_matches_hf():
    """n-gram drafts on the MoE family (the rest of speculative decoding: tests/unit/test_spec_engine.py): HF's
    greedy ids still, drafts accepted."""
    llm = LLM(TINY, **BASE, warmup=False, speculative_config=NGRAM)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == GREEDY_IDS
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0
