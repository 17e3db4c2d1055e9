"""What every family shares: the weight pytree types, the attention and dense-MLP weight specs, and the
decoder skeleton (`decoder_forward`: embedding, attention over the paged cache, the family's MLP per
layer, final norm, lm_head).

The attention is Llama's with two switches in `ModelConfig`: `attention_bias` (Qwen2 q/k/v bias) and
`qk_norm` (Qwen3 per-head RMSNorm on q and k before RoPE). A family module (llama.py, qwen3_moe.py,
qwen3_5.py) brings its layer specs and its MLP or its own layers; every weight is described once in its
specs, and random init, sharding and checkpoint loading are derived from that table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp

from jinfer.cache.spec import AttentionKV, LayerCacheSpec
from jinfer.config.model import ModelConfig
from jinfer.models.batch import Batch
from jinfer.models.fp8 import concat_columns
from jinfer.models.layers import apply_rope, rms_norm, rope_cos_sin, write_kv
from jinfer.models.spec import ArrayInfo
from jinfer.ops import ModelOps

__all__ = ["LayerWeights", "Weights", "assemble_weights", "attention_specs", "cache_spec", "decoder_forward",
           "decoder_specs", "dense_mlp", "expert_load_output", "fuse_qkv", "lm_head_logits", "mlp_specs",
           "real_tokens"]


def cache_spec(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """The shared decoder's cache: every layer keeps paged K and V."""
    return [AttentionKV(cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers


@jax.tree_util.register_dataclass
@dataclass
class LayerWeights:
    """One layer of the attention decoders (llama, qwen3_moe): attention, then a dense or MoE MLP."""

    attn_norm: jax.Array  # [hidden]
    wq: jax.Array | None  # [hidden, H*D] (None once fused into wqkv)
    wk: jax.Array | None  # [hidden, KVH*D]
    wv: jax.Array | None  # [hidden, KVH*D]
    wo: jax.Array  # [H*D, hidden]
    mlp_norm: jax.Array  # [hidden]
    w_gate: jax.Array  # [hidden, I]; MoE layers: [E, hidden, I] (one per expert)
    w_up: jax.Array  # [hidden, I]; MoE: [E, hidden, I]
    w_down: jax.Array  # [I, hidden]; MoE: [E, I, hidden]
    bq: jax.Array | None = None  # [H*D]      qwen2
    bk: jax.Array | None = None  # [KVH*D]    qwen2
    bv: jax.Array | None = None  # [KVH*D]    qwen2
    q_norm: jax.Array | None = None  # [D]    qwen3
    k_norm: jax.Array | None = None  # [D]    qwen3
    wqkv: jax.Array | None = None  # [hidden, (H + 2*KVH)*D]: wq|wk|wv side by side (`fuse_qkv`)
    router: jax.Array | None = None  # [hidden, E]: MoE layers' router (qwen3_moe)


@jax.tree_util.register_dataclass
@dataclass
class Weights:
    """Every family's weights: the embedding, its layers (each the family's layer dataclass), the final norm."""

    embed: jax.Array  # [vocab, hidden]
    layers: list  # [LayerWeights] or a family's own layer type (qwen3_5.HybridLayer)
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None = None  # [hidden, vocab]; None when tied to embed


def attention_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    """Layer i's attention weights and the two norms around it."""
    h, q, kv, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    hf, gg = f"model.layers.{i}.", f"blk.{i}."
    specs = {
        "attn_norm": ArrayInfo((h,), ("embed",), hf + "input_layernorm.weight", gg + "attn_norm.weight", init="ones"),
        "wq": ArrayInfo((h, q), ("embed", "q_heads"), hf + "self_attn.q_proj.weight", gg + "attn_q.weight", True),
        "wk": ArrayInfo((h, kv), ("embed", "kv_heads"), hf + "self_attn.k_proj.weight", gg + "attn_k.weight", True),
        "wv": ArrayInfo((h, kv), ("embed", "kv_heads"), hf + "self_attn.v_proj.weight", gg + "attn_v.weight", True),
        "wo": ArrayInfo((q, h), ("q_heads", "embed"), hf + "self_attn.o_proj.weight", gg + "attn_output.weight",
                        True),
        "mlp_norm": ArrayInfo((h,), ("embed",), hf + "post_attention_layernorm.weight", gg + "ffn_norm.weight",
                              init="ones"),
    }
    if cfg.attention_bias:
        specs["bq"] = ArrayInfo((q,), ("q_heads",), hf + "self_attn.q_proj.bias", gg + "attn_q.bias", init="zeros")
        specs["bk"] = ArrayInfo((kv,), ("kv_heads",), hf + "self_attn.k_proj.bias", gg + "attn_k.bias", init="zeros")
        specs["bv"] = ArrayInfo((kv,), ("kv_heads",), hf + "self_attn.v_proj.bias", gg + "attn_v.bias", init="zeros")
    if cfg.qk_norm:
        specs["q_norm"] = ArrayInfo((d,), ("head_dim",), hf + "self_attn.q_norm.weight", gg + "attn_q_norm.weight",
                                    init="ones")
        specs["k_norm"] = ArrayInfo((d,), ("head_dim",), hf + "self_attn.k_norm.weight", gg + "attn_k_norm.weight",
                                    init="ones")
    return specs


def mlp_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    """Layer i's dense SwiGLU MLP."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    hf, gg = f"model.layers.{i}.mlp.", f"blk.{i}."
    return {
        "w_gate": ArrayInfo((h, inter), ("embed", "mlp"), hf + "gate_proj.weight", gg + "ffn_gate.weight", True),
        "w_up": ArrayInfo((h, inter), ("embed", "mlp"), hf + "up_proj.weight", gg + "ffn_up.weight", True),
        "w_down": ArrayInfo((inter, h), ("mlp", "embed"), hf + "down_proj.weight", gg + "ffn_down.weight", True),
    }


def decoder_specs(cfg: ModelConfig, layer_specs: Callable[[ModelConfig, int], dict[str, ArrayInfo]]
                  ) -> dict[str, ArrayInfo]:
    """Every weight of the model, keyed by its path in the `Weights` pytree ("layers.3.wq"): the embedding,
    each layer's (`layer_specs(cfg, i)`, the family's), the final norm and an untied lm_head."""
    h, v = cfg.hidden_size, cfg.vocab_size
    specs = {"embed": ArrayInfo((v, h), ("vocab", "embed"), "model.embed_tokens.weight", "token_embd.weight")}
    for i in range(cfg.num_layers):
        specs.update({f"layers.{i}.{k}": s for k, s in layer_specs(cfg, i).items()})
    specs["final_norm"] = ArrayInfo((h,), ("embed",), "model.norm.weight", "output_norm.weight", init="ones")
    if not cfg.tie_word_embeddings and not cfg.pooling:  # (an embedding model never reads an lm_head)
        specs["lm_head"] = ArrayInfo((h, v), ("embed", "vocab"), "lm_head.weight", "output.weight", True)
    return specs


def assemble_weights(cfg: ModelConfig, arrays: dict[str, jax.Array], layer_type: type = LayerWeights) -> Weights:
    """Build the `Weights` pytree from a flat {spec path: array} dict (the loaders' output), each layer a
    `layer_type` (the family's layer dataclass)."""
    layer_fields = {f.name for f in fields(layer_type)}
    layers = []
    for i in range(cfg.num_layers):
        prefix = f"layers.{i}."
        kw = {k[len(prefix):]: a for k, a in arrays.items() if k.startswith(prefix)}
        assert set(kw) <= layer_fields, set(kw) - layer_fields
        layers.append(layer_type(**kw))
    return Weights(arrays["embed"], layers, arrays["final_norm"], arrays.get("lm_head"))


def fuse_qkv(weights: Weights) -> Weights:
    """One [hidden, q+k+v] projection per layer instead of three (single device only: a sharded
    output axis would interleave the three). At batch-1 decode XLA runs each projection as its own
    matrix-vector kernel and the small k/v ones far below HBM speed; one wider kernel reads the same
    bytes faster. Same results: each output column is the same dot product."""
    layers = []
    for layer in weights.layers:
        if layer.wqkv is not None:
            layers.append(layer)
            continue
        wqkv = concat_columns([layer.wq, layer.wk, layer.wv])  # FP8 weights with their scales
        if wqkv is None:  # FP8 parts that cannot be joined (not whole blocks, or some unquantized): kept apart
            layers.append(layer)
            continue
        layers.append(dataclasses.replace(layer, wq=None, wk=None, wv=None, wqkv=wqkv))
    return dataclasses.replace(weights, layers=layers)


def _attention(layer: LayerWeights, x: jax.Array, cos, sin, kv, batch: Batch, cfg: ModelConfig, ops: ModelOps,
               counters: jax.Array | None = None):
    """x + attention(rms_norm(x)); also returns the layer's updated (k, v) cache (an FP8 cache: (k, v, k_scale,
    v_scale), the scales passed through) and `counters` (the step's zeroed kernel counters, `ModelOps.step_counters`,
    passed from kernel to kernel)."""
    T = x.shape[0]
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    if layer.wqkv is not None:
        q_norm, k_norm = (layer.q_norm, layer.k_norm) if cfg.qk_norm else (None, None)
        fused = None if cfg.attention_bias else ops.norm_qkv_rope_write(
            x, layer.attn_norm, layer.wqkv, q_norm, k_norm, cos, sin, kv, batch.slot_mapping, H, KVH, cfg.rms_norm_eps,
            counters, prefetch=layer.wo)
        if fused is not None:
            *fused, counters = fused
        else:
            (qkv,) = ops.norm_projections(x, layer.attn_norm, (layer.wqkv,), cfg.rms_norm_eps)
            fused = None if cfg.attention_bias else ops.qkv_rope_write(
                qkv, q_norm, k_norm, cos, sin, kv, batch.slot_mapping, H, KVH, cfg.rms_norm_eps)
        if fused is not None:
            q, k_cache, v_cache = fused
            out = ops.attention(q, k_cache, v_cache, batch, D**-0.5, *kv[2:])  # [T, H, D]
            return ops.out_proj(out.reshape(T, H * D), layer.wo, x), (k_cache, v_cache, *kv[2:]), counters
        q, k, v = jnp.split(qkv, [H * D, (H + KVH) * D], axis=-1)
    else:
        q, k, v = ops.norm_projections(x, layer.attn_norm, (layer.wq, layer.wk, layer.wv), cfg.rms_norm_eps)
    if cfg.attention_bias:
        q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
    q, k, v = q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
    if cfg.qk_norm:
        q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache, v_cache = write_kv(kv[0], kv[1], k, v, batch.slot_mapping, *kv[2:])
    out = ops.attention(q, k_cache, v_cache, batch, D**-0.5, *kv[2:])  # [T, H, D]
    return ops.out_proj(out.reshape(T, H * D), layer.wo, x), (k_cache, v_cache, *kv[2:]), counters


def dense_mlp(layer: LayerWeights, i: int, x: jax.Array, cfg: ModelConfig, ops: ModelOps,
              counters: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
    """x + SwiGLU(rms_norm(x)): the dense families' MLP block (the step's counters passed on)."""
    return ops.mlp_block(x, layer.mlp_norm, layer.w_gate, layer.w_up, layer.w_down, cfg.rms_norm_eps), counters


MlpFn = Callable[[LayerWeights, int, jax.Array, ModelConfig, ModelOps, jax.Array | None],
                 tuple[jax.Array, jax.Array | None]]


def decoder_forward(weights: Weights, batch: Batch, kv_cache: tuple[tuple[jax.Array, jax.Array], ...],
                    cfg: ModelConfig, ops: ModelOps, mlp: MlpFn, aux_layers: tuple[int, ...] = (),
                    expert_load: bool = False):
    """The decoder every family shares: embedding, per layer attention then the family's `mlp` block
    (`mlp(layer, i, x, cfg, ops, counters) -> (x + mlp(norm(x)), counters)`), final norm and lm_head.
    Returns (logits [N, vocab] float32, new cache).

    Layers are unrolled in Python (one executable, no scan): measured faster than `lax.scan` over
    stacked weights for decode on the H100.

    `aux_layers` (static; an EAGLE-3 drafter's inputs, jinfer/models/eagle3.py): also return the residual stream
    at these layer boundaries for every row of the step, concatenated in the order given, as a third output
    [T, len(aux_layers) * hidden]. Boundary i is the input of layer i, HF's `output_hidden_states[i]` (0: the
    embedding); boundary `num_layers` is the last layer's output before the final norm (HF's last entry is after
    it). Empty (the default): nothing is traced for it, the step's program is the plain one.

    `expert_load` (static; the expert-load recorder, `--expert-load-stats`): `mlp` is also given `num_real` (the
    step's real tokens, `real_tokens`) and a MoE layer's returns a third value, its experts' counts of (token, slot)
    pairs from those tokens; stacked, i32[MoE layers, E], they are the last output (`expert_load_output`). False (the
    default): nothing is traced for it.

    Under `jax.shard_map` (jinfer/parallel/mesh.py) this runs on each device's shards: `cfg` then holds the
    device's q / kv head counts (`parallel.local_config`) and `ops` the collectives.
    """
    if any(not 0 <= i <= cfg.num_layers for i in aux_layers):
        raise ValueError(f"aux_layers={aux_layers} must be layer boundaries in [0, {cfg.num_layers}]")
    x = ops.embed(weights.embed, batch.input_ids, cfg.vocab_size)  # [T, hidden]
    cos, sin = rope_cos_sin(batch.positions, cfg, x.dtype)
    new_cache = []
    counters = ops.step_counters(x.shape[0])
    captured, loads = {}, []
    record = {"num_real": real_tokens(batch)} if expert_load else {}
    for i, (layer, kv) in enumerate(zip(weights.layers, kv_cache, strict=True)):
        if i in aux_layers:
            captured[i] = x
        x, kv, counters = _attention(layer, x, cos, sin, kv, batch, cfg, ops, counters)
        x, counters, *load = mlp(layer, i, x, cfg, ops, counters, **record)  # (a MoE layer's counts with `record`)
        loads += load
        new_cache.append(kv)
    logits = lm_head_logits(weights, x, batch, cfg, ops)
    captured[cfg.num_layers] = x
    aux = (jnp.concatenate([captured[i] for i in aux_layers], axis=-1),) if aux_layers else ()
    return logits, tuple(new_cache), *aux, *expert_load_output(loads, cfg, expert_load)


def real_tokens(batch: Batch) -> jax.Array:
    """i32[]: the step's real tokens, its first rows (the padding rows come after them: `Batch.query_start`)."""
    return batch.query_start[-1]


def expert_load_output(loads: list[jax.Array], cfg: ModelConfig, expert_load: bool) -> tuple[jax.Array, ...]:
    """The forward's last output with `expert_load`: the MoE layers' expert counts (`ops.moe.expert_counts`, [E] each,
    in layer order) stacked, i32[MoE layers, E]; () without."""
    if not expert_load:
        return ()
    if not loads:
        raise ValueError(f"expert_load: {cfg.architecture!r} has no mixture-of-experts layer to count")
    return (jnp.stack(loads),)


def lm_head_logits(weights: Weights, x: jax.Array, batch: Batch, cfg: ModelConfig, ops: ModelOps) -> jax.Array:
    """The logits [N, vocab] (float32) of the rows the sampler reads: final norm, then lm_head (the
    embedding's transpose when tied). An embedding model (`cfg.pooling`, static: its own executables) returns
    those rows' normed hidden states instead, L2-normalised, [N, hidden] float32: a row is a sequence's last
    token once its prompt is complete, so this is last-token pooling."""
    x = rms_norm(x[batch.logits_indices], weights.final_norm, cfg.rms_norm_eps)  # [N, hidden]
    if cfg.pooling:
        x = x.astype(jnp.float32)
        # torch's F.normalize (what Qwen3-Embedding's model card uses): x / max(|x|, 1e-12)
        return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)
    head = weights.embed.T if weights.lm_head is None else weights.lm_head
    return ops.lm_head(x, head, cfg.vocab_size)
