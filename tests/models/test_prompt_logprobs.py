"""Prompt logprobs (vLLM's `SamplingParams.prompt_logprobs`) against HF transformers: the golden
`prompt_logprobs_tiny-qwen3.npz` (scripts/make_golden.py --only prompt-logprobs) holds each prompt token's
logprob and the top 5 of its position from HF's float32 logits. The engine computes them from the prefill's
own logits, across chunked-prefill steps (16-token budget) and where a prefix is cached."""

import numpy as np
import pytest

from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA

GOLDEN = np.load(DATA / "golden" / "prompt_logprobs_tiny-qwen3.npz")
PROMPTS = [GOLDEN[f"prompt_{i}"].tolist() for i in range(4)]
TOL = 1e-3


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DATA / "tiny-qwen3"), dtype="float32", page_size=4, max_model_len=128,
               max_num_batched_tokens=16, max_num_seqs=8, warmup=False, compilation_cache_dir="")


def check(plp, i, k):
    prompt = PROMPTS[i]
    assert len(plp) == len(prompt) and plp[0] is None
    for j in range(1, len(prompt)):
        ref_lp, ref_ids, ref_top = (GOLDEN[f"logprobs_{i}"][j - 1], GOLDEN[f"top_ids_{i}"][j - 1],
                                    GOLDEN[f"top_logprobs_{i}"][j - 1])
        entry = plp[j]  # {token id: Logprob}, the prompt token first (vLLM's order)
        assert next(iter(entry)) == prompt[j] and abs(entry[prompt[j]].logprob - ref_lp) < TOL, (i, j)
        top = sorted(((lp.logprob, t) for t, lp in entry.items() if t != prompt[j] or t in ref_ids[:k]),
                     reverse=True)[:k]
        np.testing.assert_allclose([v for v, _ in top], ref_top[:k], atol=TOL, err_msg=f"prompt {i} pos {j}")
        assert {t for _, t in top} == set(ref_ids[:k].tolist()), (i, j)
        assert len(entry) in (k, k + 1)  # the top k, plus the prompt token when it is not among them
        # ranks: the top k are 1..k; the prompt token's is its place among them, else 1 + the tokens HF scores above
        assert sorted(lp.rank for t, lp in entry.items() if t != prompt[j]) == \
            [r for r in range(1, k + 1) if r != entry[prompt[j]].rank][:len(entry) - 1]
        rank, in_top = entry[prompt[j]].rank, prompt[j] in ref_ids[:k]
        assert rank == ref_ids[:k].tolist().index(prompt[j]) + 1 if in_top else rank > k, (i, j)


def test_prompt_logprobs_match_hf_chunked(llm):
    # prompts of 6, 45, 90 and 52 tokens, a 16-token step budget: every long prompt spans several steps
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=5, ignore_eos=True))
    for i, out in enumerate(outs):
        check(out.prompt_logprobs, i, 5)
    plain = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                         SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prompt_logprobs_with_a_cached_prefix(llm):
    # prompt 3 repeats prompt 2's first 32 tokens, whose pages the previous test left in the prefix cache
    warm = llm.generate({"prompt_token_ids": PROMPTS[3]}, SamplingParams(temperature=0.0, max_tokens=1))[0]
    assert warm.num_cached_tokens >= 32  # a plain request does hit the cache...
    out = llm.generate({"prompt_token_ids": PROMPTS[3]},
                       SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, n=2))[0]
    assert out.num_cached_tokens == 0  # ...one with prompt logprobs computes the whole prompt (as vLLM)
    check(out.prompt_logprobs, 3, 0)
    assert len(out.outputs) == 2
