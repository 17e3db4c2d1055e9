"""DeepSeek-V2 / V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`; Kimi-K2 and Moonlight are V3): multi-head
latent attention (MLA) over a latent paged KV cache, and DeepSeekMoE.

MLA (HF `DeepseekV2Attention`): q is `wq` (or `wq_a` -> RMSNorm -> `wq_b` with a q low rank), split per head
into a no-RoPE part (qk_nope_head_dim) and a RoPE part (qk_rope_head_dim). `wkv_a` gives each token a latent c
(kv_lora_rank, RMSNorm'd) and one RoPE key k_pe shared by every head. K and V of head h would be c @ W_UK[h] (| k_pe)
and c @ W_UV[h] (`wkv_b` = [W_UK | W_UV] per head); the cache keeps only the row [c | rope(k_pe)]
(`cache.spec.LatentKV`: 576 values per token for V2/V3). The reference (and decode) runs the absorbed form: q_nope @
W_UK[h]^T is head h's query in the latent space, scored against c, with q_pe against k_pe; the weighted latent goes
through W_UV[h], then `wo`. Equal to HF's expanded form (a change of summation order only), which the Pallas ops use
for a long chunk's own new tokens (`ModelOps.mla_attention`, jinfer/ops/attention.py).

RoPE is DeepSeek's interleaved one (pairs (2i, 2i + 1); V3's `rope_interleave: false` is the rotate-half form),
with YaRN's inverse frequencies; YaRN multiplies cos/sin by its attention factor and the softmax scale
(head_dim ** -0.5) by mscale(factor, mscale_all_dim) ** 2, as HF does.

DeepSeekMoE: the first `mlp_only_layers` (HF `first_k_dense_replace`) are dense SwiGLU, the rest route to
experts (`ModelOps.grouped_moe_block`: V2's softmax or V3's sigmoid + correction bias, group-limited top-k,
routed scaling) beside `num_shared_experts` shared experts (one SwiGLU of that many times the expert width).
V3's multi-token-prediction layer (layer num_layers in the checkpoint) is not loaded.

Sharded (`parallel.mesh`): the heads split (q, `wkv_b`, `wo` by head; psum after `wo`), the latent projection and
the latent cache replicated (every head reads every row); experts as qwen3_moe's.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jinfer.cache.spec import LatentKV, LayerCacheSpec
from jinfer.config.model import ModelConfig
from jinfer.config.rope import yarn_attention_factor, yarn_softmax_mscale
from jinfer.models.base import Weights, decoder_specs, expert_load_output, lm_head_logits, mlp_specs, real_tokens
from jinfer.models.base import assemble_weights as _assemble
from jinfer.models.batch import Batch
from jinfer.models.fp8 import dense
from jinfer.models.layers import apply_rope, rms_norm, rope_cos_sin
from jinfer.models.qwen3_moe import moe_specs
from jinfer.models.shared_experts import stacked_count
from jinfer.models.spec import ArrayInfo
from jinfer.ops import REFERENCE_OPS, ModelOps

__all__ = ["MlaLayer", "assemble_weights", "cache_spec", "forward", "fuse_qkv", "layer_specs", "weight_specs"]

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: HF builds them with the default eps, not rms_norm_eps


@jax.tree_util.register_dataclass
@dataclass
class MlaLayer:
    """One DeepSeek layer: latent attention, then a dense MLP or DeepSeekMoE."""

    attn_norm: jax.Array  # [hidden]
    wkv_a: jax.Array  # [hidden, kv_lora_rank + rope]: the latent and the shared RoPE key
    kv_a_norm: jax.Array  # [kv_lora_rank]
    wkv_b: jax.Array  # [kv_lora_rank, H * (nope + v)]: per head W_UK | W_UV
    wo: jax.Array  # [H * v, hidden]
    mlp_norm: jax.Array  # [hidden]
    w_gate: jax.Array  # [hidden, I]; MoE layers: [E, hidden, I]
    w_up: jax.Array  # [hidden, I]; MoE: [E, hidden, I]
    w_down: jax.Array  # [I, hidden]; MoE: [E, I, hidden]
    wq: jax.Array | None = None  # [hidden, H * (nope + rope)]: without a q low rank
    wq_a: jax.Array | None = None  # [hidden, q_lora_rank]
    q_a_norm: jax.Array | None = None  # [q_lora_rank]
    wq_b: jax.Array | None = None  # [q_lora_rank, H * (nope + rope)]
    router: jax.Array | None = None  # [hidden, E]
    router_bias: jax.Array | None = None  # [E]: V3's e_score_correction_bias
    ws_gate: jax.Array | None = None  # [hidden, shared * I_moe]: the shared experts, one SwiGLU
    ws_up: jax.Array | None = None
    ws_down: jax.Array | None = None


def cache_spec(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """Every layer keeps one latent row per token: [kv_lora_rank + qk_rope_head_dim]."""
    return [LatentKV(cfg.latent_dim)] * cfg.num_layers


def attention_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    h, heads, r = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank
    hf, gg = f"model.layers.{i}.", f"blk.{i}."
    a = hf + "self_attn."
    specs = {
        "attn_norm": ArrayInfo((h,), ("embed",), hf + "input_layernorm.weight", gg + "attn_norm.weight", init="ones"),
        "wkv_a": ArrayInfo((h, cfg.latent_dim), ("embed", None), a + "kv_a_proj_with_mqa.weight",
                           gg + "attn_kv_a_mqa.weight", True),
        "kv_a_norm": ArrayInfo((cfg.kv_lora_rank,), (None,), a + "kv_a_layernorm.weight", gg + "attn_kv_a_norm.weight",
                               init="ones"),
        "wkv_b": ArrayInfo((cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)), (None, "q_heads"),
                           a + "kv_b_proj.weight", gg + "attn_kv_b.weight", True),
        "wo": ArrayInfo((heads * cfg.v_head_dim, h), ("q_heads", "embed"), a + "o_proj.weight",
                        gg + "attn_output.weight", True),
        "mlp_norm": ArrayInfo((h,), ("embed",), hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight",
                              init="ones"),
    }
    if not r:
        specs["wq"] = ArrayInfo((h, cfg.q_size), ("embed", "q_heads"), a + "q_proj.weight", gg + "attn_q.weight", True)
        return specs
    return specs | {
        "wq_a": ArrayInfo((h, r), ("embed", None), a + "q_a_proj.weight", gg + "attn_q_a.weight", True),
        "q_a_norm": ArrayInfo((r,), (None,), a + "q_a_layernorm.weight", gg + "attn_q_a_norm.weight", init="ones"),
        "wq_b": ArrayInfo((r, cfg.q_size), (None, "q_heads"), a + "q_b_proj.weight", gg + "attn_q_b.weight", True),
    }


def deepseek_moe_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    """The routed experts and router (qwen3_moe's names), V3's correction bias, the shared experts."""
    specs = moe_specs(cfg, i)
    h, hf, gg = cfg.hidden_size, f"model.layers.{i}.mlp.", f"blk.{i}."
    if cfg.scoring_func == "sigmoid":
        specs["router_bias"] = ArrayInfo((cfg.num_experts,), (None,), hf + "gate.e_score_correction_bias",
                                         gg + "exp_probs_b.bias", init="zeros", dtype="float32")
    if cfg.num_shared_experts:
        inter, s = cfg.num_shared_experts * cfg.moe_intermediate_size, hf + "shared_experts."
        specs |= {
            "ws_gate": ArrayInfo((h, inter), ("embed", "mlp"), s + "gate_proj.weight", gg + "ffn_gate_shexp.weight",
                                 True),
            "ws_up": ArrayInfo((h, inter), ("embed", "mlp"), s + "up_proj.weight", gg + "ffn_up_shexp.weight", True),
            "ws_down": ArrayInfo((inter, h), ("mlp", "embed"), s + "down_proj.weight", gg + "ffn_down_shexp.weight",
                                 True),
        }
    return specs


def layer_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    mlp = deepseek_moe_specs(cfg, i) if cfg.is_moe_layer(i) else mlp_specs(cfg, i)
    return attention_specs(cfg, i) | mlp


def weight_specs(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    return decoder_specs(cfg, layer_specs)


def assemble_weights(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> Weights:
    return _assemble(cfg, arrays, MlaLayer)


def fuse_qkv(weights: Weights) -> Weights:
    """Nothing to fuse: MLA's projections differ in their inputs (x, the q latent, the kv latent)."""
    return weights


def _rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x [T, heads, R]. Interleaved: the (even, odd) pairs are de-interleaved first (HF V3's
    `apply_rotary_pos_emb_interleave`; V2's complex rotation is the same up to this order of its output dims,
    which every q . k product sums over alike)."""
    if interleave:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


def mla_attention(layer: MlaLayer, x: jax.Array, cos: jax.Array, sin: jax.Array, latent: jax.Array, batch: Batch,
                  cfg: ModelConfig, ops: ModelOps) -> tuple[jax.Array, jax.Array]:
    """x + MLA(rms_norm(x)) and the latent cache with this step's rows written. x: [T, hidden]; latent:
    [pages, page_size, kv_lora_rank + rope]. Under shard_map `cfg.num_heads` is this device's share."""
    T, H = x.shape[0], cfg.num_heads
    nope, rope, dv, rank = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
    if layer.wq is not None:
        q = ops.project(h, layer.wq)
    else:
        q = ops.project(rms_norm(ops.project(h, layer.wq_a), layer.q_a_norm, LATENT_NORM_EPS), layer.wq_b)
    q = q.reshape(T, H, nope + rope)
    kv = ops.project(h, layer.wkv_a)  # [T, rank + rope]
    c = rms_norm(kv[:, :rank], layer.kv_a_norm, LATENT_NORM_EPS)  # [T, rank]
    k_pe = _rope(kv[:, None, rank:], cos, sin, cfg.rope_interleave)[:, 0]  # [T, rope]
    q_pe = _rope(q[..., nope:], cos, sin, cfg.rope_interleave)  # [T, H, rope]
    rows = jnp.concatenate([c, k_pe], axis=-1)  # [T, rank + rope]
    latent = write_latent(latent, rows, batch.slot_mapping)
    w_kv = dense(layer.wkv_b, x.dtype).reshape(rank, H, nope + dv)  # (an FP8 wkv_b dequantized)
    scale = (nope + rope) ** -0.5 * yarn_softmax_mscale(cfg.rope_scaling)
    out = ops.mla_attention(q[..., :nope], q_pe, rows, w_kv, latent, batch, scale)  # [T, H, v]
    return ops.out_proj(out.reshape(T, H * dv), layer.wo, x), latent


def write_latent(latent: jax.Array, rows: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter the new tokens' latent rows [T, L] into their flat slots; padding tokens (slot < 0) go to the
    reserved page 0 (as `layers.write_kv`)."""
    pages, page_size, dim = latent.shape
    slots = jnp.where(slot_mapping < 0, 0, slot_mapping)
    flat = latent.reshape(pages * page_size, dim).at[slots].set(rows.astype(latent.dtype), mode="promise_in_bounds",
                                                               unique_indices=True)
    return flat.reshape(latent.shape)


def mlp(layer: MlaLayer, i: int, x: jax.Array, cfg: ModelConfig, ops: ModelOps, counters: jax.Array | None = None,
        num_real: jax.Array | None = None) -> tuple:
    """(x + the layer's MLP, counters), and a MoE layer given `num_real` its expert counts
    (`ModelOps.grouped_moe_block`; `counters`: the step's, `ModelOps.step_counters`, passed on)."""
    if not cfg.is_moe_layer(i):
        return ops.mlp_block(x, layer.mlp_norm, layer.w_gate, layer.w_up, layer.w_down, cfg.rms_norm_eps), counters
    shared = (layer.ws_gate, layer.ws_up, layer.ws_down) if layer.ws_gate is not None else None
    return ops.grouped_moe_block(x, layer.mlp_norm, layer.router, layer.router_bias, layer.w_gate, layer.w_up,
                                 layer.w_down, shared, top_k=cfg.num_experts_per_tok, n_group=cfg.n_group,
                                 topk_group=cfg.topk_group, sigmoid=cfg.scoring_func == "sigmoid",
                                 renormalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor,
                                 eps=cfg.rms_norm_eps, counters=counters, num_real=num_real,
                                 stacked=stacked_count(layer, cfg.num_experts))  # (shared_experts.py)


def forward(weights: Weights, batch: Batch, kv_cache: tuple[tuple[jax.Array], ...], cfg: ModelConfig,
            ops: ModelOps = REFERENCE_OPS, aux_layers: tuple[int, ...] = (), expert_load: bool = False):
    """One step over a flattened ragged batch: (logits [N, vocab] float32, the updated latent cache, one (latent,)
    per layer), and with `aux_layers` the hidden states at those layer boundaries, with `expert_load` the MoE layers'
    expert counts last (as `base.decoder_forward`)."""
    if any(not 0 <= i <= cfg.num_layers for i in aux_layers):
        raise ValueError(f"aux_layers={aux_layers} must be layer boundaries in [0, {cfg.num_layers}]")
    x = ops.embed(weights.embed, batch.input_ids, cfg.vocab_size)  # [T, hidden]
    cos, sin = rope_cos_sin(batch.positions, cfg, jnp.float32)  # [T, rope]
    factor = yarn_attention_factor(cfg.rope_scaling)
    cos, sin = (cos * factor).astype(x.dtype), (sin * factor).astype(x.dtype)
    new_cache, captured, loads = [], {}, []
    record = {"num_real": real_tokens(batch)} if expert_load else {}
    counters = ops.step_counters(x.shape[0])
    for i, (layer, (latent,)) in enumerate(zip(weights.layers, kv_cache, strict=True)):
        captured[i] = x
        x, latent = mla_attention(layer, x, cos, sin, latent, batch, cfg, ops)
        x, counters, *load = mlp(layer, i, x, cfg, ops, counters, **record)
        loads += load
        new_cache.append((latent,))
    logits = lm_head_logits(weights, x, batch, cfg, ops)
    captured[cfg.num_layers] = x
    aux = (jnp.concatenate([captured[i] for i in aux_layers], axis=-1),) if aux_layers else ()
    return logits, tuple(new_cache), *aux, *expert_load_output(loads, cfg, expert_load)
