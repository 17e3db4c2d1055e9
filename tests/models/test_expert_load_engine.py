"""--expert-load-stats through the whole engine on the tiny Qwen3-MoE checkpoint, on two fake devices with expert
parallel: every step read back is counted, its tokens are the step's scheduled tokens (padding rows excluded), each MoE
layer routes them x top_k, each rank's share is its experts' (rank r: experts [4r, 4r + 4)), and the greedy ids are
still HF's. The counting itself against an independent router, one device and two: tests/unit/test_expert_load.py."""

import numpy as np
import pytest

from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA

pytestmark = pytest.mark.slow  # a whole engine (~20 s on two cores)

TINY = str(DATA / "tiny-qwen3_moe")
GOLD = np.load(DATA / "golden" / "tiny-qwen3_moe.npz")
PROMPTS = [GOLD[f"prompt_{i}"].tolist() for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# 16-token steps: the prompts prefill in chunks, then 3-sequence decodes padded to the 8-token bucket
BASE = dict(dtype="float32", page_size=4, max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
            compilation_cache_dir="", warmup=False, expert_load_stats=True)


def run(**kw):
    """An engine's greedy ids for PROMPTS, the tokens each launched step scheduled, and the engine."""
    llm = LLM(TINY, **BASE, **kw)
    core, scheduled = llm.engine, []
    launch = core.runner.launch

    def counting_launch(out, *args, **kwargs):
        scheduled.append(out.num_scheduled_tokens)
        return launch(out, *args, **kwargs)

    core.runner.launch = counting_launch
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], scheduled, core


@pytest.fixture(scope="module")
def expert_parallel():
    return run(tensor_parallel_size=2, enable_expert_parallel=True)


def test_every_step_counts_its_real_tokens(expert_parallel):
    ids, scheduled, core = expert_parallel
    assert ids == [GOLD[f"greedy_{i}"].tolist()[:8] for i in range(3)]  # the flag changes no output
    rec, k = core.expert_load, core.model_config.num_experts_per_tok
    assert rec.layers == (0, 2) and rec.ranks == 2
    assert rec.steps == core.num_steps_total == len(scheduled)
    assert [s.tokens for s in rec.history] == scheduled  # steps are read back in launch order
    assert any(n not in core.runner.token_buckets for n in scheduled)  # steps with padding rows, not counted
    np.testing.assert_array_equal(rec.cumulative.sum(1), [sum(scheduled) * k] * 2)
    np.testing.assert_array_equal(rec.last_counts.sum(1), [scheduled[-1] * k] * 2)
    stats = core.stats()
    assert stats["expert_load_steps_total"] == rec.steps
    assert sum(stats[f"expert_load_expert_tokens_total_{e}"] for e in range(8)) == 2 * sum(scheduled) * k
    assert stats["expert_load_expert_imbalance_sum"] > rec.steps  # 8 experts, top-2 of few tokens: never even


def test_expert_parallel_ranks_split_the_counts(expert_parallel):
    _, _, ep = expert_parallel
    rec, stats = ep.expert_load, ep.stats()
    per_rank = [stats[f"expert_load_rank_tokens_total_{r}"] for r in range(2)]
    assert per_rank == [int(rec.cumulative[:, :4].sum()), int(rec.cumulative[:, 4:].sum())]
    step = rec.history[-1]
    last = rec.last_counts.reshape(2, 2, 4).sum(-1)  # [layers, ranks]
    assert step.rank_tokens == tuple(last.sum(0))
    assert step.imbalance == pytest.approx(last.max(1).sum() * 2 / last.sum()) and step.imbalance >= 1.0


def test_dense_model_refused():
    with pytest.raises(ValueError, match="expert_load_stats=True needs a mixture-of-experts model"):
        LLM(str(DATA / "tiny-qwen3"), **BASE)
