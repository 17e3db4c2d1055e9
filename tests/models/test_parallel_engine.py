"""The whole engine on several (fake CPU) devices: tensor parallel dense and MoE, expert parallel MoE,
against HF's greedy ids (scheduler, paged KV split by kv heads, chunked prefill, prefix cache, async
scheduling, warm-up buckets, the executable cache's warm start); and the checks on what can be split."""

import numpy as np
import pytest

from jinfer.config.model import ModelConfig
from jinfer.engine.args import add_engine_arguments, engine_config_kwargs
from jinfer.llm import LLM
from jinfer.parallel.mesh import check_parallel
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
BASE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8)


def gold(arch):
    g = np.load(DATA / "golden" / f"tiny-{arch}.npz")
    return [g[f"prompt_{i}"].tolist() for i in range(3)], [g[f"greedy_{i}"].tolist() for i in range(3)]


# (One Pallas engine: its attention kernels and MoE kernels under shard_map, kv heads replicated (tp 4 > 2 kv heads),
# whole experts; kv heads split (tp 2) with the Pallas kernels and q/k/v biases: test_parallel_golden.py's
# qwen2-tp2-pallas forward against HF's logits, and kv heads split in the engine: the qwen3_moe tp 2 case here.)
@pytest.mark.parametrize("arch,tp,ep,backend", [("qwen3", 4, False, "reference"),
                                                ("qwen3_moe", 2, False, "reference"),
                                                ("qwen3_moe", 4, True, "pallas")])
def test_engine_greedy_matches_hf(arch, tp, ep, backend, tmp_path):
    prompts, greedy = gold(arch)
    # (the Pallas cases' own executable cache, for the warm start below; the others the run's compilation cache,
    # which the data parallel test's first replica, on the same two devices, loads from)
    # (the Pallas engine with 8-token steps: one token bucket and its decode-only form, each a sharded interpreted
    # forward that takes long to compile)
    kw = dict(BASE, tensor_parallel_size=tp, enable_expert_parallel=ep, attention_backend=backend,
              compilation_cache_dir=str(tmp_path) if backend == "pallas" else "", warmup=backend == "pallas",
              **({"max_num_batched_tokens": 8} if backend == "pallas" else {}))
    llm = LLM(str(DATA / f"tiny-{arch}"), **kw)
    core = llm.engine
    assert core.runner.mesh.size == tp
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy
    hits = core.kv.num_hit_tokens  # the same prompts again: prefix-cache hits, same tokens
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[::-1]], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == greedy[::-1]
    assert core.kv.num_hit_tokens > hits and core.kv.num_free_pages == core.kv.num_usable_pages
    if backend == "pallas":
        assert core.runner.compiles_after_warmup == 0
        # a second engine loads the sharded executables from the cache instead of compiling them
        warm = LLM(str(DATA / f"tiny-{arch}"), **kw)
        assert warm.engine.runner.executables.misses == 0 and warm.engine.runner.executables.hits > 0
        outs = warm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
        assert list(outs[0].outputs[0].token_ids) == greedy[0]


def config(**kw):
    base = dict(architecture="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                num_heads=8, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, mlp_only_layers=(1,))
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("kw,tp,ep,match", [
    ({}, 3, False, "num_heads=8"),
    ({"num_heads": 12, "num_kv_heads": 3}, 2, False, "num_kv_heads=3"),
    ({"intermediate_size": 90}, 4, False, "intermediate_size=90"),
    ({"moe_intermediate_size": 36}, 8, False, "moe_intermediate_size=36"),
    ({"num_experts": 12}, 8, True, "num_experts=12"),
    ({"architecture": "qwen3", "num_experts": 0, "mlp_only_layers": ()}, 2, True, "mixture-of-experts"),
])
def test_check_parallel_names_the_field(kw, tp, ep, match):
    with pytest.raises(ValueError, match=match):
        check_parallel(config(**kw), tp, ep)


def test_check_parallel_accepts_replicated_kv_heads_and_experts_split_either_way():
    check_parallel(config(), 8, False)  # kv heads replicated 4x, experts split by columns (32 / 8)
    check_parallel(config(), 8, True)  # one expert per device


def test_engine_refuses_more_devices_than_there_are():
    with pytest.raises(ValueError, match="tensor_parallel_size=16"):
        LLM(str(DATA / "tiny-qwen3"), **BASE, tensor_parallel_size=16, warmup=False)


def test_cli_flags():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    add_engine_arguments(ap)
    kw = engine_config_kwargs(ap.parse_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"]))
    assert kw["tensor_parallel_size"] == 2 and kw["enable_expert_parallel"] is True
    assert engine_config_kwargs(ap.parse_args(["-tp", "4"]))["tensor_parallel_size"] == 4


def test_offline_data_parallel_replicas_on_disjoint_devices():
    """LLM(data_parallel_size=2, tensor_parallel_size=2): two engines on devices {0,1} and {2,3}, the prompts
    shared out, HF's greedy ids for every prompt. (Each replica as the tp=2 MoE case's engine.)"""
    prompts, greedy = gold("qwen3_moe")
    llm = LLM(str(DATA / "tiny-qwen3_moe"), **BASE, tensor_parallel_size=2, data_parallel_size=2,
              enable_expert_parallel=False, warmup=False, compilation_cache_dir="", attention_backend="reference")
    meshes = [sorted(d.id for d in e.runner.mesh.devices.flat) for e in llm.engines]
    assert meshes == [[0, 1], [2, 3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * 2], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy * 2
    assert all(e.num_generation_tokens_total > 0 for e in llm.engines)  # both replicas worked
    with pytest.raises(ValueError, match="data_parallel_size=5"):
        LLM(str(DATA / "tiny-qwen3"), **BASE, tensor_parallel_size=2, data_parallel_size=5, warmup=False)
