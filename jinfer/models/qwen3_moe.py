"""Qwen3-MoE (`Qwen3MoeForCausalLM`, GGUF `qwen3moe`): Qwen3 attention with mixture-of-experts MLPs.

Everything but the MLP is the shared decoder (base.py: attention over the paged cache, q/k norms, RoPE,
embedding, lm_head). A sparse layer (`ModelConfig.is_moe_layer`, HF's rule from
`mlp_only_layers` and `decoder_sparse_step`) has a router `[hidden, E]` and its experts' SwiGLU
weights stacked per layer (`[E, hidden, I]` gate and up, `[E, I, hidden]` down); the other layers
keep the dense MLP. Routing is HF's (softmax over the experts in float32, top-k, renormalised when
`norm_topk_prob`); `ModelOps.moe_block` picks the kernels.
"""

from __future__ import annotations

import jax

from jinfer.config.model import ModelConfig
from jinfer.models.base import (
    LayerWeights,
    Weights,
    assemble_weights,
    attention_specs,
    cache_spec,
    decoder_forward,
    decoder_specs,
    dense_mlp,
    fuse_qkv,
    mlp_specs,
)
from jinfer.models.batch import Batch
from jinfer.models.spec import EXPERT, ArrayInfo
from jinfer.ops import REFERENCE_OPS, ModelOps

__all__ = ["assemble_weights", "cache_spec", "forward", "fuse_qkv", "layer_specs", "moe_specs", "weight_specs"]


def moe_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    """Layer i's router and stacked experts."""
    h, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    hf, gg = f"model.layers.{i}.mlp.", f"blk.{i}."
    expert = f"{hf}experts.{EXPERT}."
    fused_gate_up = f"{hf}experts.gate_up_proj"  # transformers' in-memory layout: [E, 2*I, hidden], gate first
    return {
        "router": ArrayInfo((h, e), ("embed", None), hf + "gate.weight", gg + "ffn_gate_inp.weight", True),
        "w_gate": ArrayInfo((e, h, inter), ("experts", "embed", "moe_mlp"), expert + "gate_proj.weight",
                            gg + "ffn_gate_exps.weight", True, hf_fused=(fused_gate_up, 0, 2)),
        "w_up": ArrayInfo((e, h, inter), ("experts", "embed", "moe_mlp"), expert + "up_proj.weight",
                          gg + "ffn_up_exps.weight", True, hf_fused=(fused_gate_up, 1, 2)),
        "w_down": ArrayInfo((e, inter, h), ("experts", "moe_mlp", "embed"), expert + "down_proj.weight",
                            gg + "ffn_down_exps.weight", True, hf_fused=(f"{hf}experts.down_proj", 0, 1)),
    }


def layer_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    mlp = moe_specs(cfg, i) if cfg.is_moe_layer(i) else mlp_specs(cfg, i)
    return attention_specs(cfg, i) | mlp


def weight_specs(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    return decoder_specs(cfg, layer_specs)


def moe_or_dense_mlp(layer: LayerWeights, i: int, x: jax.Array, cfg: ModelConfig, ops: ModelOps,
                     counters: jax.Array | None = None, num_real: jax.Array | None = None) -> tuple:
    """(x + the layer's MLP, counters); a MoE layer given `num_real` adds its expert counts (`ModelOps.moe_block`)."""
    if not cfg.is_moe_layer(i):
        return dense_mlp(layer, i, x, cfg, ops, counters)
    return ops.moe_block(x, layer.mlp_norm, layer.router, layer.w_gate, layer.w_up, layer.w_down,
                         top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob, eps=cfg.rms_norm_eps,
                         counters=counters, num_real=num_real)


def forward(
    weights: Weights,
    batch: Batch,
    kv_cache: tuple[tuple[jax.Array, jax.Array], ...],
    cfg: ModelConfig,
    ops: ModelOps = REFERENCE_OPS,
    aux_layers: tuple[int, ...] = (),
    expert_load: bool = False,
):
    """One step over a flattened ragged batch. Returns (logits [N, vocab] float32, updated kv_cache), and with
    `aux_layers` the hidden states at those layer boundaries too, with `expert_load` the MoE layers' expert counts
    last (`base.decoder_forward`)."""
    return decoder_forward(weights, batch, kv_cache, cfg, ops, moe_or_dense_mlp, aux_layers, expert_load)
