"""Qwen3.5's multi-token-prediction (MTP) layer, the draft head of speculative decoding's "mtp" method (vLLM's
vllm/model_executor/models/qwen3_5_mtp.py; Qwen3.5 checkpoints ship one under `mtp.*`).

With H the hidden size: `fc` [2H -> H] of concat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)), one
gated full-attention decoder layer as the target's (qwen3_5.py: gated queries, q/k norm, partial RoPE, a dense
SwiGLU MLP), `norm`; the target's embedding and lm_head. Every norm is zero-centred (1 + w, added at load).

Positions: the head's row at position p reads the target's last hidden state at p *after its final norm* (what vLLM's
target model returns; here the target's residual stream at boundary `num_layers`, normed with the target's final
norm) and the token at p + 1, and predicts the token at p + 2. A chain is one pass over the target step's rows, then
k - 1 one-token steps, each feeding the previous draft at the next position with the previous step's output (after
`norm`). The layer has its own paged KV on the target's page tables, as the EAGLE-3 head (eagle3.py), whose chain
batches (`chain_batch`) it uses. Pure and jit-able; the target's ModelConfig is static.

Not built: MoE checkpoints' MTP layer (Qwen3.5-MoE: a sparse MLP), several MTP layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from jinfer.cache.spec import AttentionKV
from jinfer.config.model import ModelConfig
from jinfer.models.batch import Batch
from jinfer.models.eagle3 import greedy_chain
from jinfer.models.layers import rms_norm, rope_cos_sin
from jinfer.models.qwen3_5 import HybridLayer, fuse_layer_qkv, gated_attention, layer_specs
from jinfer.models.spec import ArrayInfo
from jinfer.ops import REFERENCE_OPS, ModelOps

__all__ = ["MtpWeights", "assemble_weights", "cache_spec", "draft_forward", "propose", "weight_specs"]

KV = tuple[jax.Array, jax.Array]
PREFIX = "mtp."
NORMS = ("embed_norm", "hidden_norm", "final_norm", "layer.attn_norm", "layer.mlp_norm", "layer.q_norm",
         "layer.k_norm")


@jax.tree_util.register_dataclass
@dataclass
class MtpWeights:
    embed: jax.Array  # [V, H] the target's
    lm_head: jax.Array  # [H, V] the target's (its embedding's transpose when tied)
    target_norm: jax.Array  # [H] the target's final norm (1 + w): turns its residual stream into its hidden state
    fc: jax.Array  # [2H, H]
    embed_norm: jax.Array  # [H] pre_fc_norm_embedding (1 + w)
    hidden_norm: jax.Array  # [H] pre_fc_norm_hidden (1 + w)
    layer: HybridLayer  # a gated full-attention layer
    final_norm: jax.Array  # [H] mtp.norm (1 + w)


def _full_attention_layer(cfg: ModelConfig) -> int:
    return next(i for i in range(cfg.num_layers) if not cfg.is_linear_layer(i))


def weight_specs(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    """The MTP layer's tensors under the checkpoint's `mtp.` names, replicated (the head is small)."""
    if cfg.num_experts:
        raise ValueError("an MTP layer with a mixture-of-experts MLP (Qwen3.5-MoE) is not supported")
    h, i = cfg.hidden_size, _full_attention_layer(cfg)

    def rep(spec: ArrayInfo, name: str) -> ArrayInfo:
        return dataclasses.replace(spec, axes=(None,) * len(spec.shape), hf_name=name, gguf_name="")

    specs = {f"layer.{k}": rep(s, s.hf_name.replace(f"model.layers.{i}.", PREFIX + "layers.0."))
             for k, s in layer_specs(cfg, i).items()}
    norm = ArrayInfo((h,), (None,), "", "", init="zeros")
    return specs | {
        "fc": ArrayInfo((2 * h, h), (None, None), PREFIX + "fc.weight", "", True),
        "embed_norm": rep(norm, PREFIX + "pre_fc_norm_embedding.weight"),
        "hidden_norm": rep(norm, PREFIX + "pre_fc_norm_hidden.weight"),
        "final_norm": rep(norm, PREFIX + "norm.weight"),
    }


def assemble_weights(cfg: ModelConfig, arrays: dict[str, jax.Array], target) -> MtpWeights:
    """The pytree from `weight_specs`' arrays (zero-centred norms get their 1) and the target's `Weights`."""
    a = {k: (v + 1 if k in NORMS else v) for k, v in arrays.items()}
    layer = HybridLayer(**{k.removeprefix("layer."): a.pop(k) for k in list(a) if k.startswith("layer.")})
    layer = fuse_layer_qkv(layer)  # (q | k | v as one projection, as the target's on one device)
    head = target.embed.T if target.lm_head is None else target.lm_head
    return MtpWeights(target.embed, head, target.final_norm, layer=layer, **a)


def cache_spec(cfg: ModelConfig) -> AttentionKV:
    """The MTP layer's paged KV, on the target's pages."""
    return AttentionKV(cfg.num_kv_heads, cfg.head_dim)


def draft_forward(weights: MtpWeights, cfg: ModelConfig, batch: Batch, hidden: jax.Array, kv: KV,
                  ops: ModelOps = REFERENCE_OPS) -> tuple[jax.Array, jax.Array, KV]:
    """One pass of the MTP layer over a packed batch: `batch.input_ids` the tokens it reads (each row's next token),
    `hidden` [T, H] each row's h (the target's hidden state, or the previous step's output). Returns (logits [N, V]
    float32 at `batch.logits_indices`, the rows' output after `norm` [T, H]: the next step's h, the updated KV)."""
    dtype = weights.embed.dtype
    e = rms_norm(ops.embed(weights.embed, batch.input_ids, cfg.vocab_size), weights.embed_norm, cfg.rms_norm_eps)
    h = rms_norm(hidden.astype(dtype), weights.hidden_norm, cfg.rms_norm_eps)
    x = ops.project(jnp.concatenate([e, h], axis=-1), weights.fc)  # [T, H]
    cos, sin = rope_cos_sin(batch.positions, cfg, x.dtype)
    layer = weights.layer
    x, kv = gated_attention(layer, x, cos, sin, kv, batch, cfg, ops)
    x = ops.mlp_block(x, layer.mlp_norm, layer.w_gate, layer.w_up, layer.w_down, cfg.rms_norm_eps)
    y = rms_norm(x, weights.final_norm, cfg.rms_norm_eps)
    logits = ops.project(y[batch.logits_indices], weights.lm_head, preferred_element_type=jnp.float32)
    return logits, y, kv


def propose(weights: MtpWeights, cfg: ModelConfig, batch: Batch, aux: jax.Array, kv: KV, num_steps: int,
            ops: ModelOps = REFERENCE_OPS, live: jax.Array | None = None) -> tuple[jax.Array, KV]:
    """A greedy chain of `num_steps` drafts per sequence (as `eagle3.propose`): `batch` the target step's rows with
    `input_ids` shifted by one and `logits_indices` [B] each sequence's last accepted row; `aux` [T, H] the target's
    residual stream after its last layer (before its final norm). Returns (drafts [B, num_steps] int32, the KV)."""
    hidden = rms_norm(aux.astype(weights.embed.dtype), weights.target_norm, cfg.rms_norm_eps)
    return greedy_chain(partial(draft_forward, weights, cfg), lambda logits: jnp.argmax(logits, -1).astype(jnp.int32),
                        batch, hidden, kv, num_steps, ops, live)
