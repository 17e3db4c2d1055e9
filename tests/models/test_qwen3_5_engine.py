"""The tiny Qwen3.5 checkpoint through the whole engine (scheduler, paged KV for the attention layer, a
state slot per sequence for the Gated DeltaNet layers, chunked prefill, preemption, n > 1, async
scheduling, warm-up buckets) against HF's greedy ids; the tiny Qwen3.5-MoE one through chunked prefill and
preemption (its layers are Qwen3.5's, so the other paths are the same)."""

import logging

import numpy as np
import pytest

from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA

pytestmark = pytest.mark.slow  # whole engines, each built and compiled for its own configuration

TINY = str(DATA / "tiny-qwen3_5")
GOLD = np.load(DATA / "golden" / "tiny-qwen3_5.npz")
PROMPTS = [GOLD[f"prompt_{i}"].tolist() for i in range(3)]  # 5, 37 and 80 tokens
GREEDY_IDS = [GOLD[f"greedy_{i}"].tolist() for i in range(3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
BASE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_seqs=8, compilation_cache_dir="")


def generate(llm, params=GREEDY, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def llm32():
    """32-token steps, room for 9 sequences: the greedy, fork and no-room tests share this engine (its executables
    compiled once)."""
    return LLM(TINY, **(BASE | {"max_num_seqs": 9}), max_num_batched_tokens=32, warmup=False)


def assert_all_free(llm):
    kv = llm.engine.kv
    assert kv.num_free_state_slots == kv.num_state_slots - 1 and kv.num_free_pages == kv.num_usable_pages


def test_engine_greedy_matches_hf_with_chunked_prefill(llm32, caplog):
    """32-token steps: chunks cut through HF's 64-row delta-rule chunk (next to the other prompts, the 80-token
    prompt's rows 0-21, 21-51, 51-80). (7-token chunks, cutting the conv window: the preemption test's engine.)"""
    assert not llm32.engine.kv.enable_prefix_caching
    assert [o[0] for o in generate(llm32)] == GREEDY_IDS
    assert_all_free(llm32)


# qwen3_5: 7-token steps (chunks of 1-7 rows next to the other sequences' decodes, cutting the conv window of 3 rows)
# in a pool too small for all three. The MoE model: 8-token steps and 16-token pages, so that two executables serve
# the whole run (each is seconds of compile on CPU).
PREEMPT = {"qwen3_5": dict(max_num_batched_tokens=7, num_pages=33),
           "qwen3_5_moe": dict(max_num_batched_tokens=8, num_pages=10, page_size=16)}


@pytest.mark.parametrize("arch", PREEMPT)
def test_small_chunks_and_preemption_recompute_the_state(arch, caplog):
    """A pool too small for all three: the newest is preempted, loses its slot and recomputes its state
    from position 0 (its slot may meanwhile hold another sequence's state). The 80-token prompt prefills in
    chunks beside the others' decodes. Prefix caching is off (and says so) for a model with a state."""
    gold = np.load(DATA / "golden" / f"tiny-{arch}.npz")
    with caplog.at_level(logging.INFO, logger="jinfer.engine.core"):
        llm = LLM(str(DATA / f"tiny-{arch}"), **(BASE | PREEMPT[arch]), warmup=False)
    assert "prefix caching is off" in caplog.text
    sched = llm.engine.scheduler
    preempted = []
    original = sched._preempt
    sched._preempt = lambda r: (preempted.append(r.request_id), original(r))
    prompts = [gold[f"prompt_{i}"].tolist() for i in range(3)]
    assert [o[0] for o in generate(llm, prompts=prompts)] == [gold[f"greedy_{i}"].tolist() for i in range(3)]
    assert preempted
    assert_all_free(llm)


# Tensor parallel on both models, expert parallel on the MoE (attention and linear-attention heads split too; the
# tiny models' 2 linear key heads allow 2 ways, tiny-qwen3_5_moe_h4's 4 four), 8-token steps: chunks beside decodes;
# the reference ops, and the Pallas kernels (interpreted) on the expert-parallel MoE
SHARDED = [("qwen3_5", 2, False, "auto"), ("qwen3_5_moe", 2, False, "auto"), ("qwen3_5_moe", 2, True, "auto"),
           ("qwen3_5_moe", 2, True, "pallas"), ("qwen3_5_moe_h4", 1, False, "auto"),
           ("qwen3_5_moe_h4", 2, False, "auto"),  # two key heads a shard (their value heads' grouping within it)
           ("qwen3_5_moe_h4", 4, False, "auto"), ("qwen3_5_moe_h4", 4, True, "auto"),
           ("qwen3_5_moe_h4", 4, True, "pallas")]


@pytest.mark.parametrize("arch,n,ep,backend", SHARDED,
                         ids=lambda c: str(c) if not isinstance(c, bool) else ("ep" if c else "tp"))
def test_several_devices_match_hf(arch, n, ep, backend):
    """On n (fake CPU) devices: the linear-attention layers' heads, channels and states split (q | k | v per
    shard), the gated attention's heads too (kv heads repeated past 2), the experts by columns (tp) or whole (ep, two
    a device at 4): HF's greedy ids."""
    gold = np.load(DATA / "golden" / f"tiny-{arch}.npz")
    llm = LLM(str(DATA / f"tiny-{arch}"), **BASE, tensor_parallel_size=n, enable_expert_parallel=ep,
              max_num_batched_tokens=8, warmup=False, attention_backend=backend)
    runner = llm.engine.runner
    linear = next(layer for layer in runner.weights.layers if layer.lin_in is not None)  # (qkv | z | b | a fused)
    conv, rec = next(runner.kv_cache[i] for i in range(len(runner.kv_cache)) if runner.cfg.is_linear_layer(i))
    for a, axis in [(linear.lin_in, 1), (linear.conv_w, 0), (linear.lin_out, 0), (conv, 2),
                    (rec, 1)]:  # (states: [slots, K, channels], [slots, Hv, Dk, Dv])
        assert a.shape[axis] // a.sharding.shard_shape(a.shape)[axis] == n
    # the shared expert stacked after the routed ones (split by columns as they are) but under expert parallel
    assert all((layer.ws_gate is None) != ep for layer in runner.weights.layers if layer.router is not None)
    prompts = [gold[f"prompt_{i}"].tolist() for i in range(3)]
    assert [o[0] for o in generate(llm, prompts=prompts)] == [gold[f"greedy_{i}"].tolist() for i in range(3)]
    assert_all_free(llm)


def test_n_samples_fork_from_the_first(llm32):
    """n = 3: the first sample computes all but the prompt's last token, the others fork from it (its full pages
    shared, the partial page and the state slot copied) and compute only the last token: every sample matches
    HF's greedy ids, seeded samples match n = 1 requests with the same seeds, and nothing leaks. (Async scheduling
    here; forks in a synchronous engine: test_qwen3_5_spec's n = 2 test, whose drafts make it synchronous.)"""
    runner = llm32.engine.runner
    assert llm32.engine._async
    forks = []
    original = runner.fork
    runner.fork = lambda pages, slots: (forks.append((list(pages), list(slots))), original(pages, slots))
    try:
        outs = llm32.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(
            n=3, temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
        assert [[list(c.token_ids) for c in o.outputs] for o in outs] == [[g] * 3 for g in GREEDY_IDS]
        # two followers of each prompt forked: a state slot each, a page copy where the shared prefix (5, 37, 80
        # tokens less the last: 4, 36, 79) ends inside a page of 4 tokens
        assert sum(len(sl) for _, sl in forks) == 6 and sum(len(p) for p, _ in forks) == 2
        assert_all_free(llm32)

        forks.clear()
        sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
        got = [list(c.token_ids) for c in llm32.generate([{"prompt_token_ids": PROMPTS[2]}], sampled,
                                                         use_tqdm=False)[0].outputs]
        assert forks and len(set(map(tuple, got))) > 1
        alone = [list(llm32.generate([{"prompt_token_ids": PROMPTS[2]}],
                                     SamplingParams(temperature=1.0, seed=7 + i, max_tokens=16, ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0].token_ids) for i in range(3)]
        assert got == alone
        assert_all_free(llm32)
    finally:
        runner.fork = original


def test_n_samples_that_cannot_fork_run_alone(llm32):
    """n = 12 in room for 9 sequences: the followers that find no room when the leader reaches its fork point queue
    as plain requests and compute the prompt themselves."""
    runner = llm32.engine.runner
    forked = []
    original = runner.fork
    runner.fork = lambda pages, slots: (forked.extend(slots), original(pages, slots))
    try:
        params = SamplingParams(n=12, temperature=0.0, max_tokens=4, ignore_eos=True)
        assert generate(llm32, params, PROMPTS[1:2]) == [[GREEDY_IDS[1][:4]] * 12]
    finally:
        runner.fork = original
    assert 0 < len(forked) < 11  # some followers forked, the others computed the prompt alone
    assert_all_free(llm32)


def test_pallas_backend_warm_buckets_decode_only_and_async():
    """Pallas kernels (interpreted on CPU), every bucket compiled at warm-up (the forks' copies too): no compile
    while serving. max_num_seqs = max_num_batched_tokens = 8 (one bucket): steps where every sequence decodes run its
    decode-only executable, whose Gated DeltaNet layers are the fused decode kernel (most of its rows padding, on
    the reserved slot 0); the greedy ids are still HF's. (The chunked kernel, >= 64 new rows of one sequence in a
    step, next to recurrent rows: test_golden_qwen3_5's pallas cases.)"""
    llm = LLM(TINY, **BASE, max_num_batched_tokens=8, attention_backend="pallas")
    runner = llm.engine.runner
    used, original = [], runner.forward_executable
    runner.forward_executable = lambda T, B, P, decode, *a: (used.append(decode), original(T, B, P, decode, *a))[1]
    assert [o[0] for o in generate(llm)] == GREEDY_IDS
    assert any(used) and not all(used)  # decode-only steps, and mixed ones
    params = SamplingParams(n=3, temperature=0.0, max_tokens=4, ignore_eos=True)
    assert generate(llm, params, PROMPTS[1:2]) == [[GREEDY_IDS[1][:4]] * 3]
    assert runner.compiles_after_warmup == 0


def test_tensor_parallel_needs_whole_linear_heads_and_shared_width():
    from jinfer.parallel.mesh import check_parallel
    from jinfer.weights.loader import resolve_model

    cfg = resolve_model(TINY).config  # 2 linear key heads, 4 value heads, 4 attention heads
    check_parallel(cfg, 2)
    with pytest.raises(ValueError, match="linear_num_key_heads=2"):
        check_parallel(cfg, 4)
    moe = resolve_model(DATA / "tiny-qwen3_5_moe_h4").config
    check_parallel(moe, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=66"):  # (ep: the shared expert by columns)
        check_parallel(moe.replace(shared_expert_intermediate_size=66), 4, expert_parallel=True)
    with pytest.raises(ValueError, match="FP8 linear-attention"):
        check_parallel(moe.replace(quantization=resolve_model("dummy:qwen3-8b-fp8").config.quantization), 2)


def test_state_slot_bytes_are_each_devices_share():
    """The pool sizing's bytes per state slot on each device: the states split by heads, tp ways."""
    import jax.numpy as jnp

    from jinfer.cache.layout import state_bytes_per_slot
    from jinfer.weights.loader import resolve_model

    cfg = resolve_model(TINY).config
    whole = state_bytes_per_slot(cfg, jnp.float32)
    conv = cfg.linear_conv_kernel_dim * cfg.linear_conv_dim * 4
    rec = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    assert whole == 2 * (conv + rec)  # (two linear layers)
    assert state_bytes_per_slot(cfg, jnp.float32, 2) == whole // 2
