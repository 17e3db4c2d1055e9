"""The HF config.json fields of the hybrid Qwen3.5 family (`Qwen3_5*` and `Qwen3_5Moe*`), for
`ModelConfig.from_hf_config`: layer types, the Gated DeltaNet shapes, the partial rotary factor, and the MoE
models' shared expert. JAX-free and independent of model.py (which imports it).
"""

from __future__ import annotations

from typing import Any

__all__ = ["hybrid_from_hf", "positive_int"]


def positive_int(what: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what}={value!r} must be a positive integer")
    return value


def hybrid_from_hf(cfg: dict[str, Any], num_layers: int, arch: str, moe: bool) -> dict[str, Any]:
    """qwen3_5's fields: layer types (HF's default: every `full_attention_interval`-th layer full), the
    Gated DeltaNet shapes and the partial rotary factor (in `rope_parameters` or at the top level). With `moe`
    (Qwen3.5-MoE) also the shared expert's width, and `intermediate_size` where config.json has none: every layer
    is sparse there (HF's Qwen3_5MoeTextConfig has no dense MLP), so the field only has to be valid."""
    types = cfg.get("layer_types")
    if types is None:
        interval = positive_int("config field 'full_attention_interval'", cfg.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list):
        raise ValueError(f"config field 'layer_types'={types!r} must be a list")
    out = {"layer_types": tuple(types)}
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim"):
        if cfg.get(name) is None:
            raise ValueError(f"config field {name!r} is missing (architecture {arch})")
        out[name] = positive_int(f"config field {name!r}", cfg[name])
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if isinstance(factor, bool) or not isinstance(factor, int | float):
        raise ValueError(f"config field 'partial_rotary_factor'={factor!r} must be a number")
    out["partial_rotary_factor"] = float(factor)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field 'hidden_act'={cfg['hidden_act']!r} is not supported (silu only)")
    if moe:
        # HF builds the shared expert unconditionally (Qwen3_5MoeSparseMoeBlock): the field is required
        out["shared_expert_intermediate_size"] = positive_int("config field 'shared_expert_intermediate_size'",
                                                              cfg.get("shared_expert_intermediate_size"))
        if cfg.get("intermediate_size") is None:
            out["intermediate_size"] = positive_int("config field 'moe_intermediate_size'",
                                                    cfg.get("moe_intermediate_size"))
    return out
