"""The FP8 KV cache (`kv_cache_dtype="fp8"`): its option, its layout (e4m3 pages, a float32 scale per layer and kv
head, split over the mesh with the heads), twice the pages in the same memory, the checkpoint's scales, the models
it refuses, and an engine's greedy tokens against HF's. (The kernels: tests/kernels; the golden forwards:
tests/models/test_golden_tiny.py.)"""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from safetensors.numpy import save_file

from jinfer.cache.layout import check_kv_dtype, init_kv_cache, kv_cache_bytes_per_page
from jinfer.config.engine import EngineConfig
from jinfer.engine.builder import _auto_num_pages
from jinfer.parallel.mesh import make_mesh
from jinfer.weights.loader import load_kv_scales, resolve_model
from pallas_kernels.kv_fp8 import KV_FP8_DTYPE

from ..conftest import DATA

F8 = KV_FP8_DTYPE


def test_option_names_and_refusals():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3", dtype="bfloat16").kv_cache_dtype == "fp8"  # vLLM's other name
    for bad in ("fp8_e5m2", "int8", "fp8_e4m3fnuz"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='{bad}'"):
            EngineConfig(kv_cache_dtype=bad)


def test_latent_cache_refused():
    """DeepSeek's latent (MLA) cache is not built in FP8: a ValueError naming kv_cache_dtype, before any array."""
    cfg = resolve_model(DATA / "tiny-deepseek_v2").config
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported for deepseek"):
        check_kv_dtype(cfg, F8)
    check_kv_dtype(cfg, jnp.bfloat16)


class _Device:
    """A device whose memory_stats say how much memory the KV pool may take."""

    def memory_stats(self):
        return {"bytes_limit": 2**30, "bytes_in_use": 0}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_twice_the_pages_in_the_same_memory(arch):
    """Bytes per page halve against bf16 (the scales are per layer, not per page), so the pool sized from the
    device's memory holds twice the pages; Qwen3.5's linear-attention states stay in the model's dtype and take
    the same bytes either way."""
    cfg = resolve_model(DATA / f"tiny-{arch}").config
    assert kv_cache_bytes_per_page(cfg, 16, jnp.bfloat16) == 2 * kv_cache_bytes_per_page(cfg, 16, F8)
    kw = dict(max_num_seqs=4096, max_model_len=4096, page_size=16)
    slots = 5 if arch == "qwen3_5" else 0
    bf16 = _auto_num_pages(EngineConfig(**kw), cfg, "bfloat16", slots, _Device())
    fp8 = _auto_num_pages(EngineConfig(**kw, kv_cache_dtype="fp8"), cfg, "bfloat16", slots, _Device())
    assert fp8 in (2 * bf16, 2 * bf16 + 1)  # (each a floor of budget / page bytes)
    cache = init_kv_cache(cfg, 4, 16, jnp.bfloat16, make_mesh(1), slots, kv_dtype=F8)
    assert {tuple(str(a.dtype) for a in layer) for layer in cache} == (
        {("float8_e4m3fn", "float8_e4m3fn", "float32", "float32")} | ({("bfloat16", "float32")} if slots else set()))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layout_on_a_mesh(tp):
    """Per attention layer (k, v, k_scale, v_scale): e4m3 pages and float32 scales, both split by kv head over the
    mesh; with more devices than kv heads (4 > 2) each head's scale repeats with its pages. Checkpoint scales land
    on their layer, per head."""
    cfg = resolve_model(DATA / "tiny-qwen3").config
    mesh = make_mesh(tp)
    scales = {1: (np.array([0.5, 2.0], np.float32), np.array([1.5, 0.25], np.float32))}
    cache = init_kv_cache(cfg, 8, 4, jnp.float32, mesh, kv_dtype=F8, kv_scales=scales)
    heads = max(2, tp)
    for i, (k, v, ks, vs) in enumerate(cache):
        assert k.dtype == v.dtype == F8 and k.shape == (8, 4, heads, 32)
        assert ks.dtype == vs.dtype == jnp.float32 and ks.shape == vs.shape == (heads,)
        assert ks.sharding.spec == vs.sharding.spec == PartitionSpec("tp") and k.sharding.spec[2] == "tp"
        want = scales[i] if i in scales else (np.ones(2), np.ones(2))
        np.testing.assert_array_equal(np.asarray(ks), np.repeat(want[0], heads // 2))
        np.testing.assert_array_equal(np.asarray(vs), np.repeat(want[1], heads // 2))


def test_checkpoint_scales(tmp_path):
    """vLLM's `self_attn.k_scale` / `v_scale` tensors: per tensor (broadcast) or per kv head, a missing one 1.0;
    a bad one a ValueError naming kv_cache_dtype and the tensor."""
    src = DATA / "tiny-qwen3"
    for f in src.iterdir():
        if f.name != "model.safetensors.index.json":  # (without the index every .safetensors file is read)
            shutil.copy(f, tmp_path / f.name)
    save_file({"model.layers.0.self_attn.k_scale": np.array(0.5, np.float32),
               "model.layers.1.self_attn.v_scale": np.array([2.0, 4.0], np.float32)}, tmp_path / "kv.safetensors")
    scales = load_kv_scales(resolve_model(tmp_path))
    assert sorted(scales) == [0, 1]
    np.testing.assert_array_equal(np.stack(scales[0]), [[0.5, 0.5], [1.0, 1.0]])
    np.testing.assert_array_equal(np.stack(scales[1]), [[1.0, 1.0], [2.0, 4.0]])
    assert load_kv_scales(resolve_model("dummy:qwen3-8b")) == {}
    save_file({"model.layers.0.self_attn.v_scale": np.array([1.0, 2.0, 3.0], np.float32)}, tmp_path / "kv.safetensors")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8'.*model.layers.0.self_attn.v_scale"):
        load_kv_scales(resolve_model(tmp_path))


def test_engine_greedy_matches_hf():
    """The whole engine with an FP8 cache (prefill chunks of 16 tokens, then decodes) on tiny Qwen3: HF's greedy
    tokens for its golden prompts (37 tokens and 31 decodes at most; tests/models/test_golden_tiny.py checks the
    logits, within 0.3 of HF's)."""
    from jinfer.llm import LLM
    from jinfer.sampling_params import SamplingParams

    gold = np.load(DATA / "golden" / "tiny-qwen3.npz")
    llm = LLM(str(DATA / "tiny-qwen3"), dtype="float32", kv_cache_dtype="fp8_e4m3", page_size=4, max_model_len=96,
              max_num_batched_tokens=16, max_num_seqs=4, num_pages=80, warmup=False, compilation_cache_dir="")
    layer = llm.engine.runner.kv_cache[0]
    assert [a.dtype for a in layer] == [F8, F8, jnp.float32, jnp.float32]
    prompts = [{"prompt_token_ids": gold[f"prompt_{i}"].tolist()} for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=len(gold["greedy_0"]), ignore_eos=True))
    for i, out in enumerate(outs):
        assert list(out.outputs[0].token_ids) == gold[f"greedy_{i}"].tolist(), f"prompt {i}"
    assert jax.tree.leaves(llm.engine.runner.kv_cache)[0].dtype == F8
