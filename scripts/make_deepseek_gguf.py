#!/usr/bin/env python
"""Convert the tiny HF DeepSeek-V2 / V3 checkpoints (tests/data/tiny-deepseek_v2, tiny-deepseek_v3) to `deepseek2`
GGUF files as llama.cpp's convert_hf_to_gguf.py (`DeepseekV2Model`, `--outtype f32`) writes them, for the golden
tests of jinfer's GGUF loader (tests/models/test_deepseek_gguf.py). Run once; the outputs are committed:

    /work/main/.venv/bin/python scripts/make_deepseek_gguf.py

Needs numpy, safetensors and the `gguf` package (gguf-py: its writer and tensor-name map), not torch.

What the converter does, and this script with it:
- metadata: TextModel's generic keys (the config's sizes, `head_count_kv` 1 (MLA as MQA), expert counts and groups,
  the gating function from `scoring_func`, YaRN's type / factor / original context / betas) and DeepseekV2Model's
  (`leading_dense_block_count`, `q_lora_rank` when set, `kv_lora_rank`, `key_length` / `value_length` of the latent
  (kv_lora_rank + rope, kv_lora_rank), `key_length_mla` / `value_length_mla` of the heads, expert width, shared
  count, `expert_weights_scale`, `expert_weights_norm` only when true, `rope.dimension_count`, and
  `rope.scaling.yarn_log_multiplier` = 0.1 * mscale_all_dim (llama.cpp divides the 0.1 back out; YaRN's `mscale`
  itself is not written: llama.cpp takes it equal to mscale_all_dim, as in every published DeepSeek config);
- tensors: HF names through gguf-py's DEEPSEEK2 map; experts stacked [E, out, in] per layer; V3's
  `e_score_correction_bias` as `exp_probs_b.bias`; `kv_b_proj` split per head into `attn_k_b` (W_UK transposed,
  [H, kv_lora_rank, nope]) and `attn_v_b` ([H, v, kv_lora_rank]); no rows permuted (llama.cpp's deepseek2 RoPE is
  the interleaved one HF's DeepSeek uses).

tiny-deepseek_v2 is written with `attn_kv_b` whole and the pre-split keys (`head_count_kv` = heads, `key_length` /
`value_length` of a head, no *_mla keys), as converters before llama.cpp's MLA change wrote every DeepSeek GGUF
still in circulation, so the tests read both forms. transformers 5 drops DeepSeek-V3's `scoring_func` from
config.json (V3 is always sigmoid); the published V3 / Kimi-K2 configs carry it, so it is filled in here.

tiny-deepseek_v2's YaRN has mscale 1.0 and mscale_all_dim 0.8, which no published checkpoint has and GGUF cannot
say (no mscale key). Its config is converted with the attention factor that transformers derives from them stated
as `attention_factor` (the same model in HF), which the converter writes as `rope.scaling.yarn_attn_factor`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"


def write_metadata(w: gguf.GGUFWriter, hp: dict, legacy_mla: bool) -> None:
    heads, rank, rope_dim = hp["num_attention_heads"], hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    # TextModel.set_gguf_parameters
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(heads if legacy_mla else 1)
    w.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    w.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("n_group") is not None:
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    if (score := hp.get("scoring_func")) is not None:
        w.add_expert_gating_func({"sigmoid": gguf.ExpertGatingFuncType.SIGMOID,
                                  "softmax": gguf.ExpertGatingFuncType.SOFTMAX}[score])
    if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # DeepseekV2Model.set_gguf_parameters
    w.add_leading_dense_block_count(hp.get("first_k_dense_replace", 0))
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if legacy_mla:
        w.add_key_length(hp["qk_nope_head_dim"] + rope_dim)
        w.add_value_length(hp["v_head_dim"])
    else:
        w.add_key_length(rank + rope_dim)
        w.add_value_length(rank)
        w.add_key_length_mla(hp["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(hp["v_head_dim"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp.get("n_shared_experts", 0))
    if hp.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def hf_tensors(hp: dict, tensors: dict[str, np.ndarray], legacy_mla: bool):
    """(HF-style name, array) in the converter's order, after its DeepSeek rewrites."""
    heads, nope, v = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
    experts, layers = hp["n_routed_experts"], hp["num_hidden_layers"]
    for name, data in tensors.items():
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= layers:
            continue  # V3's multi-token-prediction layer (skip_mtp)
        if ".mlp.experts." in name:
            if parts[5] != "0":
                continue
            for proj in ("down_proj", "gate_proj", "up_proj"):  # merged when the layer's last expert arrives
                if parts[6] == proj:
                    stacked = np.stack([tensors[name.replace(".experts.0.", f".experts.{e}.")] for e in range(experts)])
                    yield name.replace(".experts.0.", ".experts."), stacked
            continue
        if name.endswith("e_score_correction_bias"):
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), data
            continue
        if name.endswith("kv_b_proj.weight") and not legacy_mla:
            kv_b = data.reshape(heads, nope + v, data.shape[-1])
            yield name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))
            yield name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(kv_b[:, nope:])
            continue
        yield name, data


def state_yarn_attention_factor(hp: dict) -> None:
    """transformers' YaRN attention factor, mscale(factor, mscale) / mscale(factor, mscale_all_dim), as an explicit
    `attention_factor` where the two mscales differ."""
    rope = hp.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn" and rope.get("mscale", 1.0) != rope.get("mscale_all_dim", 1.0):
        def mscale(m: float) -> float:
            return 0.1 * m * math.log(rope["factor"]) + 1.0
        rope["attention_factor"] = mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])


def convert(src: Path, dst: Path, legacy_mla: bool, defaults: dict) -> None:
    hp = defaults | json.loads((src / "config.json").read_text())
    state_yarn_attention_factor(hp)
    tensors = load_file(src / "model.safetensors")
    w = gguf.GGUFWriter(dst, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    w.add_name(src.name)
    write_metadata(w, hp, legacy_mla)
    # the tiny checkpoints have no tokenizer; SpecialVocab reads bos / eos from config.json as the converter's does
    gguf.SpecialVocab(src, load_merges=False, n_vocab=hp["vocab_size"]).add_to_gguf(w)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, hp["num_hidden_layers"])
    for name, data in hf_tensors(hp, tensors, legacy_mla):
        new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise ValueError(f"no GGUF name for tensor {name!r}")
        w.add_tensor(new, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {dst} ({dst.stat().st_size} bytes)")


if __name__ == "__main__":
    convert(DATA / "tiny-deepseek_v2", DATA / "tiny-deepseek_v2.gguf", legacy_mla=True, defaults={})
    convert(DATA / "tiny-deepseek_v3", DATA / "tiny-deepseek_v3.gguf", legacy_mla=False,
            defaults={"scoring_func": "sigmoid"})
