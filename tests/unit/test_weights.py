"""Weight loading: GGUF (every supported quant type, llama Q/K permutation), safetensors, dummy, sharding."""

import json

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file

from jinfer.models.batch import make_batch
from jinfer.models.llama import forward, weight_specs
from jinfer.parallel.mesh import make_mesh
from jinfer.weights.loader import load_weights, resolve_model

HF_CFG = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 256, "intermediate_size": 256,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 128, "tie_word_embeddings": False,
}


def hf_tensors(seed=0) -> dict[str, np.ndarray]:
    """Random float32 weights in HF naming/layout for HF_CFG."""
    rng = np.random.default_rng(seed)
    cfg = resolve_model_from_dict(HF_CFG)
    out = {}
    for spec in weight_specs(cfg).values():
        shape = spec.checkpoint_shape()
        out[spec.hf_name] = rng.standard_normal(shape).astype(np.float32) * (0.05 if len(shape) > 1 else 1.0)
    return out


def resolve_model_from_dict(d):
    from jinfer.config.model import ModelConfig
    return ModelConfig.from_hf_config(d)


def write_hf_dir(path, tensors, cfg=HF_CFG):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's permutation of Q/K rows (the thing the loader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    mod, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{LAYER_NAMES[mod]}.{kind}"


def write_gguf(path, tensors, qtype: Q):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(64)
    for name, t in tensors.items():
        if "q_proj" in name:
            t = llama_cpp_permute(t, 4)
        elif "k_proj" in name:
            t = llama_cpp_permute(t, 2)
        if t.ndim == 1 or qtype == Q.F32:
            w.add_tensor(gguf_name(name), t)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Max abs error expected from each format on N(0, 0.05) weights.
TOLERANCE = {Q.F32: 0, Q.F16: 1e-4, Q.BF16: 1e-3, Q.Q8_0: 2e-3, Q.Q4_0: 3e-2, Q.Q4_1: 3e-2, Q.Q5_0: 2e-2}


@pytest.mark.parametrize("qtype", list(TOLERANCE), ids=lambda q: q.name)
def test_gguf_quant_types_and_qk_permutation(tmp_path, qtype):
    tensors = hf_tensors()
    src = resolve_model(write_gguf(tmp_path / "m.gguf", tensors, qtype))
    assert src.kind == "gguf" and src.config.num_kv_heads == 2 and not src.config.tie_word_embeddings
    w = load_weights(src, "float32", progress=False)
    for path, spec in weight_specs(src.config).items():
        obj = w
        for part in path.split("."):
            obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
        ref = tensors[spec.hf_name].T if spec.transpose else tensors[spec.hf_name]
        np.testing.assert_allclose(np.asarray(obj), ref, atol=TOLERANCE[qtype] + 1e-7, err_msg=path)


def test_gguf_k_quants_are_dequantized(tmp_path):
    """K-quant blocks (no Python quantizer exists) are read and dequantized by the loader like gguf does."""
    from jinfer.weights.gguf import GGUFTensorSource

    rng = np.random.default_rng(1)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    blocks = {}
    for qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(8, 256 // block * type_size), dtype=np.uint8)
        # make the fp16 super-block scales finite and small
        view = raw.reshape(8, -1, type_size)
        scale_at = type_size - 2 if qtype == Q.Q6_K else 0
        view[:, :, scale_at:scale_at + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
        if qtype != Q.Q6_K:
            view[:, :, 2:4] = np.frombuffer(np.float16(0.005).tobytes(), np.uint8)
        writer.add_tensor(f"t_{qtype.name}", raw, raw_dtype=qtype)
        blocks[qtype] = raw
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = resolve_model_from_dict(HF_CFG).replace(architecture="qwen2", attention_bias=True)
    source = GGUFTensorSource(tmp_path / "k.gguf", cfg)
    from jinfer.models.llama import ArrayInfo
    for qtype, raw in blocks.items():
        got = source.get(ArrayInfo((8, 256), (None, None), "x", f"t_{qtype.name}"))
        want = gguf.quants.dequantize(raw, qtype)
        assert got.shape == (8, 256) and np.isfinite(got).all() and np.abs(got).max() > 0
        np.testing.assert_array_equal(got, want)


def test_safetensors_and_gguf_give_same_logits(tmp_path):
    tensors = hf_tensors()
    hf = load_weights(resolve_model(write_hf_dir(tmp_path / "hf", tensors)), "float32", progress=False)
    src = resolve_model(write_gguf(tmp_path / "m.gguf", tensors, Q.F32))
    gg = load_weights(src, "float32", progress=False)
    cfg = src.config
    batch = make_batch([([1, 5, 9, 33, 2], 0, [1])], page_size=8, all_logits=True)
    kv = lambda: tuple((jnp.zeros((2, 8, 2, 64)), jnp.zeros((2, 8, 2, 64))) for _ in range(1))
    a, _ = forward(hf, batch, kv(), cfg)
    b, _ = forward(gg, batch, kv(), cfg)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_missing_and_wrong_shaped_tensors(tmp_path):
    tensors = hf_tensors()
    missing = dict(tensors)
    del missing["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="mlp.up_proj.weight.*missing"):
        load_weights(resolve_model(write_hf_dir(tmp_path / "a", missing)), "float32", progress=False)
    wrong = dict(tensors)
    wrong["model.norm.weight"] = np.ones(255, np.float32)
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(255,\).*expected \(256,\)"):
        load_weights(resolve_model(write_hf_dir(tmp_path / "b", wrong)), "float32", progress=False)
    with pytest.raises(ValueError, match="dtype"):
        load_weights(resolve_model(write_hf_dir(tmp_path / "c", tensors)), "int8", progress=False)


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="exactly one .gguf"):
        resolve_model(tmp_path)
    with pytest.raises(ValueError, match="unknown shape"):
        resolve_model("dummy:gpt5")
    for bad in ("num_layers=x", "qk_norm=1", "nope=3", "num_layers"):
        with pytest.raises(ValueError, match="integer field"):
            resolve_model(f"dummy:qwen3-235b-a22b,{bad}")
    with pytest.raises(ValueError, match="num_layers=0"):
        resolve_model("dummy:qwen3-235b-a22b,num_layers=0")


def test_dummy_shape_with_overridden_depth():
    """The 4-GPU half-depth run of Qwen3-235B-A22B: 47 of its 94 layers, each at the real shapes."""
    full, half = resolve_model("dummy:qwen3-235b-a22b").config, resolve_model("dummy:qwen3-235b-a22b,num_layers=47")
    assert half.kind == "dummy" and half.config == full.replace(num_layers=47)
    assert 117e9 < half.config.num_params() < 119e9  # 235B: half the layers, the embeddings whole


def test_dummy_weights_sharded_tp2_match_tp1(tmp_path):
    """Tensor-parallel placement (2 of the 8 fake CPU devices) computes the same logits as one device."""
    d = tmp_path / "cfg"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**HF_CFG, "num_hidden_layers": 2}))
    src = resolve_model(d, load_format="dummy")
    assert src.kind == "dummy"
    cfg = src.config
    w1 = load_weights(src, "float32", progress=False)
    w2 = load_weights(src, "float32", mesh=make_mesh(2), progress=False)
    assert w2.layers[0].wq.sharding.spec == jax.sharding.PartitionSpec(None, "tp")
    assert w2.layers[0].wo.sharding.spec == jax.sharding.PartitionSpec("tp", None)
    batch = make_batch([([1, 2, 3], 0, [1])], page_size=8)
    kv = lambda: tuple((jnp.zeros((2, 8, 2, 64)), jnp.zeros((2, 8, 2, 64))) for _ in range(cfg.num_layers))
    a, _ = jax.jit(forward, static_argnums=3)(w1, batch, kv(), cfg)
    b, _ = jax.jit(forward, static_argnums=3)(w2, batch, kv(), cfg)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
