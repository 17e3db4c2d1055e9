"""DeepSeek-V2 / V3's config fields from `deepseek2` GGUF metadata (llama.cpp's convert_hf_to_gguf.py,
`DeepseekV2Model`; also Kimi-K2 and Moonlight). JAX-free, read by `ModelConfig.from_gguf_metadata`.

What the converter writes, and how it maps to the HF config fields jinfer keeps:
- MLA shapes. Since llama.cpp's MLA change the heads' sizes are `attention.key_length_mla` (nope + rope) and
  `value_length_mla`, while `key_length` / `value_length` give the latent row (kv_lora_rank + rope, kv_lora_rank)
  and `head_count_kv` is 1; older files have no *_mla keys and give the heads' sizes in `key_length` /
  `value_length`. Either way `rope.dimension_count` is qk_rope_head_dim, and HF's num_key_value_heads (the heads)
  is kept as jinfer's num_kv_heads.
- Routing. `expert_gating_func` 1 softmax (also when absent: DeepSeek-V2 files predate the key), 2 sigmoid;
  `expert_weights_norm` (absent: false; the converter writes it only when true), `expert_weights_scale` (absent:
  1), `expert_group_count` / `expert_group_used_count` (absent: 1, ungrouped). A sigmoid-gated file is loaded as
  `deepseek_v3`, the only V3 trait the metadata carries (the forward is one for both).
- YaRN. `rope.scaling.yarn_log_multiplier` is 0.1 * HF's mscale_all_dim (llama.cpp divides it back); HF's mscale
  is not written, and llama.cpp takes it equal to mscale_all_dim (as every published DeepSeek config has it), so
  cos / sin are not rescaled unless the file gives `rope.scaling.yarn_attn_factor` (HF's attention_factor).
- RoPE on (even, odd) pairs: llama.cpp's deepseek2 uses its NORM RoPE on unpermuted weights, HF's interleaved one.
"""

from __future__ import annotations

from typing import Any

from jinfer.config.rope import RopeScaling

GATING = {1: "softmax", 2: "sigmoid"}  # gguf.ExpertGatingFuncType
YARN_LOG_MUL_SCALE = 0.1  # the converter writes 0.1 * mscale_all_dim ([TAG_DEEPSEEK2_YARN_LOG_MUL_FIX] in llama.cpp)


def latent_from_gguf(meta: dict[str, Any], arch: str, num_heads: int) -> dict[str, Any]:
    """ModelConfig fields of a `deepseek2` GGUF: MLA's ranks and head dims, routing, the leading dense layers and
    YaRN. Errors name the missing key."""
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    def req(key: str) -> int:
        value = get(key)
        if value is None:
            raise ValueError(f"GGUF field '{arch}.{key}' is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"GGUF field '{arch}.{key}'={value!r} must be a positive integer")
        return value

    rope = req("rope.dimension_count")
    mla = get("attention.key_length_mla") is not None
    head_dim = req("attention.key_length_mla" if mla else "attention.key_length")
    v_head_dim = req("attention.value_length_mla" if mla else "attention.value_length")
    if head_dim <= rope:
        raise ValueError(f"GGUF field '{arch}.attention.key_length{'_mla' if mla else ''}'={head_dim} must exceed "
                         f"'{arch}.rope.dimension_count'={rope} (a head is its no-RoPE part and its RoPE part)")
    gating = get("expert_gating_func", 1)
    if gating not in GATING:
        raise ValueError(f"GGUF field '{arch}.expert_gating_func'={gating!r} is not supported; supported: "
                         f"{GATING} (1 softmax, 2 sigmoid)")
    scoring = GATING[gating]
    return dict(
        architecture="deepseek_v3" if scoring == "sigmoid" else "deepseek_v2",
        num_kv_heads=num_heads, head_dim=head_dim,
        q_lora_rank=get("attention.q_lora_rank") or 0, kv_lora_rank=req("attention.kv_lora_rank"),
        qk_nope_head_dim=head_dim - rope, qk_rope_head_dim=rope, v_head_dim=v_head_dim, rope_interleave=True,
        num_shared_experts=int(get("expert_shared_count", 0)), scoring_func=scoring,
        n_group=int(get("expert_group_count", 1)), topk_group=int(get("expert_group_used_count", 1)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        mlp_only_layers=tuple(range(int(get("leading_dense_block_count", 0)))),
        rope_scaling=yarn_from_gguf(meta, arch),
    )


def yarn_from_gguf(meta: dict[str, Any], arch: str) -> RopeScaling:
    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.rope.scaling.{key}", default)

    if get("type") != "yarn":
        return RopeScaling()
    mscale_all_dim = float(get("yarn_log_multiplier", 0.0)) / YARN_LOG_MUL_SCALE
    return RopeScaling("yarn", float(get("factor", 1.0)),
                       original_max_position_embeddings=int(get("original_context_length", 4096)),
                       beta_fast=float(get("yarn_beta_fast", 32.0)), beta_slow=float(get("yarn_beta_slow", 1.0)),
                       mscale=mscale_all_dim, mscale_all_dim=mscale_all_dim,
                       attention_factor=float(get("yarn_attn_factor", 0.0)))
