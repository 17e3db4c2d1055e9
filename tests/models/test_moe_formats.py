"""The tiny Qwen3-MoE checkpoint in the other layouts it comes in, against the same HF goldens:

- GGUF (`qwen3moe`), written with the `gguf` package from the safetensors, tensor names from gguf's own
  HF -> GGUF map (the one llama.cpp's converter uses), experts stacked per layer;
- transformers' in-memory layout (`mlp.experts.gate_up_proj` [E, 2I, H] with gate first,
  `mlp.experts.down_proj` [E, H, I]), as some tools save it.
"""

import json
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jinfer.models.batch import make_batch
from jinfer.models.registry import forward
from jinfer.weights.loader import load_weights, resolve_model

from ..conftest import DATA

SRC = DATA / "tiny-qwen3_moe"
PAGE = 4


def _golden_logits(cfg, weights, gold):
    """Prefill logits of golden prompt 1 with the reference ops."""
    prompt = gold["prompt_1"].tolist()
    shape = (16, PAGE, cfg.num_kv_heads, cfg.head_dim)
    kv = tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.num_layers))
    batch = make_batch([(prompt, 0, list(range(1, 1 + -(-len(prompt) // PAGE))))], PAGE, all_logits=True)
    logits, _ = jax.jit(forward, static_argnums=3)(weights, batch, kv, cfg)
    return np.asarray(logits)


def _write_gguf(path, tensors, hf_cfg, qtype=gguf.GGMLQuantizationType.F32):
    n_layers = hf_cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, n_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE])
    w.add_block_count(n_layers)
    w.add_context_length(hf_cfg["max_position_embeddings"])
    w.add_embedding_length(hf_cfg["hidden_size"])
    w.add_feed_forward_length(hf_cfg["intermediate_size"])
    w.add_head_count(hf_cfg["num_attention_heads"])
    w.add_head_count_kv(hf_cfg["num_key_value_heads"])
    w.add_key_length(hf_cfg["head_dim"])
    w.add_value_length(hf_cfg["head_dim"])
    w.add_rope_freq_base(hf_cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(hf_cfg["rms_norm_eps"])
    w.add_expert_count(hf_cfg["num_local_experts"])
    w.add_expert_used_count(hf_cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hf_cfg["moe_intermediate_size"])
    w.add_vocab_size(hf_cfg["vocab_size"])
    experts: dict[str, dict[int, np.ndarray]] = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:  # model.layers.L.mlp.experts.E.gate_proj.weight -> stacked per layer
            head, e, proj, _ = name.rsplit(".", 3)
            experts.setdefault(f"{head}.{proj}", {})[int(e)] = t
            continue
        base = name.removesuffix(".weight")
        gname = names.get_name(base)
        if gname is None:  # the dense layer's MLP (llama.cpp's qwen3moe has none): plain ffn names
            layer, proj = base.split(".")[2], base.rsplit(".", 1)[1]
            gname = f"blk.{layer}.ffn_{proj.removesuffix('_proj')}"
        w.add_tensor(gname + ".weight", t if t.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32
                     else gguf.quants.quantize(t, qtype), raw_dtype=None if t.ndim == 1 else qtype)
    for base, per in experts.items():
        stacked = np.stack([per[e] for e in range(len(per))])  # [E, out, in], as llama.cpp stacks them
        w.add_tensor(names.get_name(base) + ".weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gold():
    return np.load(DATA / "golden" / "tiny-qwen3_moe.npz")


def test_gguf_qwen3moe_matches_hf(tmp_path, gold):
    hf_cfg = json.loads((SRC / "config.json").read_text())
    src = resolve_model(_write_gguf(tmp_path / "moe.gguf", load_file(SRC / "model.safetensors"), hf_cfg))
    cfg = src.config
    assert src.kind == "gguf" and cfg.architecture == "qwen3_moe" and cfg.mlp_only_layers == (1,)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size) == (32, 96)
    logits = _golden_logits(cfg, load_weights(src, "float32", progress=False), gold)
    np.testing.assert_allclose(logits, gold["prefill_logits_1"], atol=2e-4, rtol=1e-4)


def test_fused_expert_layout_matches_hf(tmp_path, gold):
    tensors = load_file(SRC / "model.safetensors")
    fused: dict[str, np.ndarray] = {}
    for layer in range(3):
        pre = f"model.layers.{layer}.mlp.experts."
        if pre + "0.gate_proj.weight" not in tensors:
            continue
        per = lambda proj: np.stack([tensors.pop(f"{pre}{e}.{proj}.weight") for e in range(8)])  # noqa: B023
        fused[pre + "gate_up_proj"] = np.concatenate([per("gate_proj"), per("up_proj")], axis=1)  # [E, 2I, H]
        fused[pre + "down_proj"] = per("down_proj")  # [E, H, I]
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(SRC / "config.json", d / "config.json")
    save_file({**tensors, **fused}, str(d / "model.safetensors"))
    src = resolve_model(d)
    logits = _golden_logits(src.config, load_weights(src, "float32", progress=False), gold)
    np.testing.assert_allclose(logits, gold["prefill_logits_1"], atol=2e-4, rtol=1e-4)


def test_missing_expert_is_named(tmp_path):
    tensors = load_file(SRC / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    d = tmp_path / "broken"
    d.mkdir()
    shutil.copy(SRC / "config.json", d / "config.json")
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.2.mlp.experts.5.up_proj.weight.*missing"):
        load_weights(resolve_model(d), "float32", progress=False)
