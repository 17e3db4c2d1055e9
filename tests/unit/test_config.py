import dataclasses
import json
import math

import pytest

from jinfer.config.engine import EngineConfig
from jinfer.config.model import NAMED_SHAPES, ModelConfig, RopeScaling, rope_inv_freq

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 256,
}


def test_from_hf_dispatch_and_defaults():
    cfg = ModelConfig.from_hf_config(LLAMA)
    assert (cfg.architecture, cfg.head_dim, cfg.num_kv_heads) == ("llama", 16, 2)
    assert not cfg.attention_bias and not cfg.qk_norm
    q2 = ModelConfig.from_hf_config({**LLAMA, "architectures": ["Qwen2ForCausalLM"]})
    assert q2.attention_bias and not q2.qk_norm
    q3 = ModelConfig.from_hf_config({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32})
    assert q3.qk_norm and q3.head_dim == 32 and q3.q_size == 128


def test_from_hf_path(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert ModelConfig.from_hf_config(tmp_path).num_layers == 2
    with pytest.raises(ValueError, match="config.json not found"):
        ModelConfig.from_hf_config(tmp_path / "nope")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_hf_config(tmp_path / "bad.json")


@pytest.mark.parametrize("change, field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"architectures": []}, "architectures"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_key_value_heads": 3}, "num_heads"),
    ({"vocab_size": -1}, "vocab_size"),
    ({"rope_scaling": {"rope_type": "yarn-ish"}}, "rope_type"),
])
def test_malformed_hf_config_names_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config({**LLAMA, **change})


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        ModelConfig.from_hf_config({**LLAMA, "architectures": ["MistralForCausalLM"]})
    with pytest.raises(ValueError, match="general.architecture"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gpt2"})


def test_missing_field_named():
    cfg = dict(LLAMA)
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="'intermediate_size' is missing"):
        ModelConfig.from_hf_config(cfg)
    with pytest.raises(ValueError, match="llama.block_count"):
        ModelConfig.from_gguf_metadata({"general.architecture": "llama", "llama.attention.head_count": 4,
                                        "llama.embedding_length": 64, "llama.vocab_size": 10,
                                        "llama.feed_forward_length": 128})


def test_llama3_rope_scaling_matches_formula():
    cfg = ModelConfig.from_hf_config({**LLAMA, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}})
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    base = rope_inv_freq(cfg.replace(rope_scaling=RopeScaling()))
    scaled = rope_inv_freq(cfg)
    assert scaled[0] == base[0]  # high frequency: untouched
    assert scaled[-1] == pytest.approx(base[-1] / 8)  # low frequency: divided by factor


def test_engine_config_page_size_and_named_shapes():
    with pytest.raises(ValueError, match="page_size"):
        EngineConfig(page_size=12)
    q = NAMED_SHAPES["qwen3-4b"]
    assert 3.9e9 < q.num_params() < 4.1e9


def test_cli_attention_backends_match_the_ops():
    """args.py lists the backends itself (the HTTP launcher must not import JAX); keep it in step."""
    import argparse

    from jinfer.config.kernels import BACKENDS
    from jinfer.engine.args import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "attention_backend")
    assert tuple(action.choices) == BACKENDS


def test_mosaic_ops_import_the_mosaic_runtime():
    """Executables holding a Mosaic GPU kernel load from the executable cache without any tracing; the
    Mosaic module must be imported first (it points the custom call at its runtime library), so
    ModelOps with mosaic_prefill imports it. Checked in a fresh interpreter."""
    import subprocess
    import sys

    code = ("import sys; from jinfer.ops import ModelOps; m = 'jax.experimental.mosaic.gpu'; "
            "ModelOps('pallas'); a = m in sys.modules; ModelOps('pallas', mosaic_prefill=True); "
            "print(a, m in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


MOE = {**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "mlp_only_layers": [1]}


def test_qwen3_moe_from_hf():
    cfg = ModelConfig.from_hf_config(MOE)
    assert cfg.architecture == "qwen3_moe" and cfg.qk_norm and cfg.norm_topk_prob
    assert [cfg.is_moe_layer(i) for i in range(2)] == [True, False]
    local = {k: v for k, v in MOE.items() if k != "num_experts"} | {"num_local_experts": 8}  # transformers 5
    assert ModelConfig.from_hf_config(local).num_experts == 8
    assert NAMED_SHAPES["qwen3-30b-a3b"].num_params(active=True) < NAMED_SHAPES["qwen3-30b-a3b"].num_params() / 8


@pytest.mark.parametrize("change, field", [
    ({"num_experts": None}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers"),
    ({"mlp_only_layers": 1}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_malformed_moe_config_names_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config({**MOE, **change})


QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                      "partial_rotary_factor": 0.25},
}


def test_qwen3_5_from_hf_and_the_multimodal_layout():
    cfg = ModelConfig.from_hf_config(QWEN3_5)  # no layer_types: HF's full_attention_interval default (4)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.rotary_dim, cfg.attention_layers, cfg.qk_norm) == (8, (3,), True)
    assert len(rope_inv_freq(cfg)) == 4
    text = {k: v for k, v in QWEN3_5.items() if k != "architectures"}
    mm = ModelConfig.from_hf_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
                                     "tie_word_embeddings": True})
    assert mm == cfg.replace(tie_word_embeddings=True)
    for name in ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b"):
        shape = NAMED_SHAPES[name]
        assert shape.layer_types.count("full_attention") * 4 == shape.num_layers and shape.rotary_dim == 64


# Qwen3.5-35B-A3B's published config.json (the fields jinfer reads; its text_config has no intermediate_size)
QWEN3_5_35B_A3B = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "tie_word_embeddings": False,
                   "text_config": {
    "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
    "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "eos_token_id": 248046,
    "rope_parameters": {"rope_type": "default", "mrope_section": [11, 11, 10], "rope_theta": 1e7,
                        "partial_rotary_factor": 0.25}}}


def test_qwen3_5_moe_from_hf_is_the_dummy_shape():
    """The published config is `dummy:qwen3.5-35b-a3b`: every layer sparse, 35B parameters of which 3.5B active; its
    weight specs hold what num_params counts. A config without the shared expert's width names the field."""
    from jinfer.models.registry import weight_specs

    cfg = ModelConfig.from_hf_config(QWEN3_5_35B_A3B)
    assert cfg == NAMED_SHAPES["qwen3.5-35b-a3b"] and all(cfg.is_moe_layer(i) for i in range(40))
    assert 34e9 < cfg.num_params() < 36e9 and 3.3e9 < cfg.num_params(active=True) < 3.6e9
    assert sum(math.prod(s.shape) for s in weight_specs(cfg).values()) == cfg.num_params()
    text = {k: v for k, v in QWEN3_5_35B_A3B["text_config"].items() if k != "shared_expert_intermediate_size"}
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        ModelConfig.from_hf_config({**QWEN3_5_35B_A3B, "text_config": text})
    with pytest.raises(ValueError, match="^shared_expert_intermediate_size="):
        NAMED_SHAPES["qwen3-30b-a3b"].replace(shared_expert_intermediate_size=-1)


@pytest.mark.parametrize("change,field", [
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["mamba"] * 4}, "layer_types"),
    ({"rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.3}}, "partial_rotary_factor"),
    ({"text_config": 3, "architectures": ["Qwen3_5ForConditionalGeneration"]}, "text_config"),
])
def test_malformed_qwen3_5_config_names_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config({**QWEN3_5, **change})
    with pytest.raises(ValueError, match="linear_key_head_dim"):
        ModelConfig.from_hf_config({k: v for k, v in QWEN3_5.items() if k != "linear_key_head_dim"})


@pytest.mark.parametrize("kw,field", [
    ({"dtype": "int8"}, "dtype"), ({"load_format": "pt"}, "load_format"), ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens"), ({"page_size": 0}, "page_size"),
    ({"max_model_len": -1}, "max_model_len"), ({"num_pages": 1.5}, "num_pages"),
    ({"gpu_memory_utilization": 0}, "gpu_memory_utilization"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"data_parallel_size": 2, "data_parallel_rank": 2}, "data_parallel_rank"),
    ({"attention_backend": "cuda"}, "attention_backend"), ({"warmup_first_tokens": 0}, "warmup_first_tokens"),
    ({"executable_keep_alive": float("inf")}, "executable_keep_alive"), ({"log_stats_interval": -1},
                                                                        "log_stats_interval"),
    ({"kv_offload_gb": 1, "enable_prefix_caching": False}, "kv_offload_gb"),
    ({"compilation_cache_dir": None}, "compilation_cache_dir"), ({"generation_config": ""}, "generation_config"),
])
def test_engine_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}="):
        EngineConfig(**kw)


def test_engine_config_travels_as_its_fields():
    """The server validates the config and sends its fields; the engine process builds the same config again."""
    cfg = EngineConfig(model="dummy:tiny", max_num_seqs=8, warmup_first_tokens=256, kv_offload_gb=0.5)
    assert EngineConfig(**json.loads(json.dumps(dataclasses.asdict(cfg)))) == cfg
    sched = cfg.scheduler_config(max_model_len=512)
    assert (sched.max_model_len, sched.max_num_seqs, sched.max_num_batched_tokens) == (512, 8, 2048)
    with pytest.raises(ValueError, match="max_num_batched_tokens=2048 must be >= max_model_len=4096"):
        dataclasses.replace(cfg, enable_chunked_prefill=False).scheduler_config(max_model_len=4096)


def test_engine_config_is_jax_free_and_reads_no_environment(monkeypatch):
    """jinfer.config.engine imports no JAX (the HTTP server validates with it); JINFER_COMPILATION_CACHE is read
    where the arguments are parsed (the CLI), not by EngineConfig."""
    import argparse
    import subprocess
    import sys

    from jinfer.engine.args import add_engine_arguments, engine_config_kwargs
    from tests.conftest import ROOT

    code = "import sys, jinfer.config.engine\nassert not [m for m in sys.modules if m.startswith('jax')]\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    monkeypatch.setenv("JINFER_COMPILATION_CACHE", "/tmp/from-env")
    assert EngineConfig().compilation_cache_dir == "~/.cache/jinfer/xla"
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_engine_arguments(parser)
    assert engine_config_kwargs(parser.parse_args([]))["compilation_cache_dir"] == "/tmp/from-env"
    given = engine_config_kwargs(parser.parse_args(["--compilation-cache-dir", ""]))
    assert given["compilation_cache_dir"] == ""
