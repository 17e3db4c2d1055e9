"""Qwen3.5 (`Qwen3_5ForCausalLM`, and the text part of `Qwen3_5ForConditionalGeneration`): a hybrid of
Gated DeltaNet (linear attention) layers and gated full-attention layers, as HF transformers computes it
(transformers/models/qwen3_5/modeling_qwen3_5.py).

- Gated attention (`layer_types[i] == "full_attention"`): q_proj gives each head's query and an output
  gate side by side ([H, 2D] per token); q/k RMSNorm, RoPE on the first `rotary_dim` dims of each head,
  attention over the paged KV cache, output times sigmoid(gate), o_proj.
- Gated DeltaNet ("linear_attention"): in_proj_qkv -> a depthwise causal conv1d (kernel K, no bias) and
  SiLU -> q | k | v; in_proj_z (the output gate), in_proj_b (beta = sigmoid), in_proj_a (the decay
  g = -exp(A_log) * softplus(a + dt_bias)); the gated delta rule (pallas_kernels/linear_attention/gated_delta_rule.py)
  with L2-normalised q and k; a per-head RMSNorm gated by silu(z); out_proj.
- Qwen3.5-MoE (`qwen3_5_moe`, HF's modeling_qwen3_5_moe.py): the same layers with a sparse MLP in every layer
  (`cfg.is_moe_layer`): softmax top-k routing renormalised (qwen3_moe's router and stacked experts, their names and
  transformers' fused `experts.gate_up_proj` layout), plus one shared SwiGLU expert whose output is scaled by
  sigmoid(x @ shared_expert_gate) per token (`ModelOps.moe_block`'s `shared`).
- Every other RMSNorm (input, post-attention, q/k, final) is zero-centred: HF multiplies by
  (1 + weight). `assemble_weights` adds the 1 once at load time, so the shared `rms_norm` and the MLP
  kernels apply them unchanged (and dummy weights initialise them to zeros, as HF does).

The cache: full-attention layers keep paged (k, v) like every family; a linear layer keeps one
fixed-size state per sequence, in a pool of slots (`state_specs`): a ring of its last K conv inputs
[S, K, conv_dim] (activation dtype; row r holds the input at the latest position = r mod K, see
linear_attention/causal_conv.py) and the recurrent state [S, Hv, Dk, Dv] (float32). A sequence reads its slot
(`Batch.state_slots`) unless its first new token is at position 0 (then it starts from zeros: admission,
recompute after preemption; the conv reads zeros before position 0), and writes its final state back.
Slot 0 is reserved for padding sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jinfer.cache.spec import AttentionKV, LayerCacheSpec, StateArray, StateSlots
from jinfer.config.model import ModelConfig
from jinfer.models import base
from jinfer.models.base import Weights, decoder_specs, lm_head_logits, mlp_specs
from jinfer.models.batch import Batch
from jinfer.models.fp8 import concat_columns
from jinfer.models.layers import apply_rope, rms_norm, rope_cos_sin, write_kv
from jinfer.models.qwen3_moe import moe_specs
from jinfer.models.shared_experts import stacked_count
from jinfer.models.spec import ArrayInfo, StateSpec
from jinfer.ops import REFERENCE_OPS, ModelOps

__all__ = ["HybridLayer", "assemble_weights", "cache_spec", "forward", "fuse_layer_qkv", "fuse_qkv", "gated_attention",
           "state_specs", "weight_specs"]

# Norms stored zero-centred in checkpoints (HF multiplies by 1 + weight); the gated norm is not.
ZERO_CENTRED = ("attn_norm", "mlp_norm", "q_norm", "k_norm")


@jax.tree_util.register_dataclass
@dataclass
class HybridLayer:
    attn_norm: jax.Array  # [hidden] (1 + HF's weight)
    mlp_norm: jax.Array  # [hidden] (1 + HF's weight)
    w_gate: jax.Array  # [hidden, I]; MoE layers: [E, hidden, I_moe]
    w_up: jax.Array  # [hidden, I]; MoE: [E, hidden, I_moe]
    w_down: jax.Array  # [I, hidden]; MoE: [E, I_moe, hidden]
    # MoE layers (qwen3_5_moe)
    router: jax.Array | None = None  # [hidden, E]
    ws_gate: jax.Array | None = None  # [hidden, I_shared]: the shared expert
    ws_up: jax.Array | None = None  # [hidden, I_shared]
    ws_down: jax.Array | None = None  # [I_shared, hidden]
    shared_gate: jax.Array | None = None  # [hidden, 1]: its output times sigmoid(x @ shared_gate)
    # gated attention layers
    wq: jax.Array | None = None  # [hidden, H * 2D]: per head D query columns then D gate columns
    wk: jax.Array | None = None  # [hidden, KVH * D]
    wv: jax.Array | None = None  # [hidden, KVH * D]
    wo: jax.Array | None = None  # [H * D, hidden]
    q_norm: jax.Array | None = None  # [D] (1 + HF's weight)
    k_norm: jax.Array | None = None  # [D]
    wqkv: jax.Array | None = None  # [hidden, H * 2D + 2 * KVH * D]: wq | wk | wv (`fuse_qkv`)
    # Gated DeltaNet layers
    lin_qkv: jax.Array | None = None  # [hidden, conv_dim]: q | k | v before the conv
    lin_z: jax.Array | None = None  # [hidden, Hv * Dv]
    lin_b: jax.Array | None = None  # [hidden, Hv]
    lin_a: jax.Array | None = None  # [hidden, Hv]
    lin_in: jax.Array | None = None  # [hidden, conv_dim + Hv * Dv + 2 * Hv]: qkv | z | b | a (`fuse_qkv`)
    conv_w: jax.Array | None = None  # [conv_dim, 1, K]
    a_log: jax.Array | None = None  # [Hv]
    dt_bias: jax.Array | None = None  # [Hv]
    lin_norm: jax.Array | None = None  # [Dv]: the gated RMSNorm's weight (plain, not zero-centred)
    lin_out: jax.Array | None = None  # [Hv * Dv, hidden]


def attention_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    h, q, kv, d = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.head_dim
    hf = f"model.layers.{i}.self_attn."
    return {
        "wq": ArrayInfo((h, 2 * q), ("embed", "q_heads"), hf + "q_proj.weight", "", True),
        "wk": ArrayInfo((h, kv), ("embed", "kv_heads"), hf + "k_proj.weight", "", True),
        "wv": ArrayInfo((h, kv), ("embed", "kv_heads"), hf + "v_proj.weight", "", True),
        "wo": ArrayInfo((q, h), ("q_heads", "embed"), hf + "o_proj.weight", "", True),
        "q_norm": ArrayInfo((d,), ("head_dim",), hf + "q_norm.weight", "", init="zeros"),
        "k_norm": ArrayInfo((d,), ("head_dim",), hf + "k_norm.weight", "", init="zeros"),
    }


def linear_attention_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    h, conv, vs, hv = cfg.hidden_size, cfg.linear_conv_dim, cfg.linear_value_size, cfg.linear_num_value_heads
    hf = f"model.layers.{i}.linear_attn."
    # (split over the mesh by value heads, `linear_heads`; q | k | v and the conv's channels are loaded whole and
    # reordered per shard: parallel/mesh.py `_linear_channels_per_shard`)
    heads = ("embed", "linear_heads")
    return {
        "lin_qkv": ArrayInfo((h, conv), ("embed", None), hf + "in_proj_qkv.weight", "", True),
        "lin_z": ArrayInfo((h, vs), heads, hf + "in_proj_z.weight", "", True),
        "lin_b": ArrayInfo((h, hv), heads, hf + "in_proj_b.weight", "", True),
        "lin_a": ArrayInfo((h, hv), heads, hf + "in_proj_a.weight", "", True),
        "conv_w": ArrayInfo((conv, 1, cfg.linear_conv_kernel_dim), (None, None, None), hf + "conv1d.weight", ""),
        "a_log": ArrayInfo((hv,), ("linear_heads",), hf + "A_log", "", init="zeros"),
        "dt_bias": ArrayInfo((hv,), ("linear_heads",), hf + "dt_bias", "", init="ones"),
        "lin_norm": ArrayInfo((cfg.linear_value_head_dim,), (None,), hf + "norm.weight", "", init="ones"),
        "lin_out": ArrayInfo((vs, h), ("linear_heads", "embed"), hf + "out_proj.weight", "", True),
    }


def shared_expert_moe_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    """A Qwen3.5-MoE layer's MLP: qwen3_moe's router and routed experts, the shared expert and its gate."""
    h, inter = cfg.hidden_size, cfg.shared_expert_intermediate_size
    hf = f"model.layers.{i}.mlp."
    s = hf + "shared_expert."
    return moe_specs(cfg, i) | {
        "ws_gate": ArrayInfo((h, inter), ("embed", "mlp"), s + "gate_proj.weight", "", True),
        "ws_up": ArrayInfo((h, inter), ("embed", "mlp"), s + "up_proj.weight", "", True),
        "ws_down": ArrayInfo((inter, h), ("mlp", "embed"), s + "down_proj.weight", "", True),
        "shared_gate": ArrayInfo((h, 1), ("embed", None), hf + "shared_expert_gate.weight", "", True),
    }


def layer_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    h = cfg.hidden_size
    hf = f"model.layers.{i}."
    norms = {
        "attn_norm": ArrayInfo((h,), ("embed",), hf + "input_layernorm.weight", "", init="zeros"),
        "mlp_norm": ArrayInfo((h,), ("embed",), hf + "post_attention_layernorm.weight", "", init="zeros"),
    }
    mixer = linear_attention_specs(cfg, i) if cfg.is_linear_layer(i) else attention_specs(cfg, i)
    return norms | mixer | (shared_expert_moe_specs(cfg, i) if cfg.is_moe_layer(i) else mlp_specs(cfg, i))


def weight_specs(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    specs = decoder_specs(cfg, layer_specs)
    specs["final_norm"] = dataclasses.replace(specs["final_norm"], init="zeros")
    return specs


def assemble_weights(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> Weights:
    """The loaders' flat dict -> `Weights` with `HybridLayer`s; zero-centred norms get their 1 added."""
    def zero_centred(path: str) -> bool:  # "final_norm", "layers.3.attn_norm"...
        return path == "final_norm" or (path.startswith("layers.") and path.rsplit(".", 1)[-1] in ZERO_CENTRED)

    arrays = {k: (a + 1 if zero_centred(k) else a) for k, a in arrays.items()}
    return base.assemble_weights(cfg, arrays, HybridLayer)


def fuse_qkv(weights: Weights) -> Weights:
    """One input projection per layer (single device): wq | wk | wv, and qkv | z | b | a in the linear
    layers (the same reason as base.fuse_qkv: small matrix-vector products run far below HBM speed)."""
    return dataclasses.replace(weights, layers=[fuse_layer_qkv(layer) for layer in weights.layers])


def fuse_layer_qkv(layer: HybridLayer) -> HybridLayer:
    """One layer's input projections joined (`fuse_qkv`; the MTP layer's, which is replicated, on any mesh)."""
    # (FP8 parts are joined with their scales; parts that cannot be, e.g. unquantized b | a beside FP8 qkv | z,
    # stay apart: `concat_columns` gives None)
    if layer.wq is not None and (w := concat_columns([layer.wq, layer.wk, layer.wv])) is not None:
        return dataclasses.replace(layer, wq=None, wk=None, wv=None, wqkv=w)
    if layer.lin_qkv is not None and (
            w := concat_columns([layer.lin_qkv, layer.lin_z, layer.lin_b, layer.lin_a])) is not None:
        return dataclasses.replace(layer, lin_qkv=None, lin_z=None, lin_b=None, lin_a=None, lin_in=w)
    return layer


def state_specs(cfg: ModelConfig) -> dict[int, tuple[StateSpec, ...]]:
    """The per-sequence state of each linear layer: (conv inputs, recurrent state), split over the mesh by heads
    (the conv's channels in their per-shard order, as its weights)."""
    conv = StateSpec((cfg.linear_conv_kernel_dim, cfg.linear_conv_dim), None, (None, "linear_heads"))  # a ring
    rec = StateSpec((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim), "float32",
                    ("linear_heads", None, None))
    return {i: (conv, rec) for i in range(cfg.num_layers) if cfg.is_linear_layer(i)}


def cache_spec(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """Linear layers: their state slots (`state_specs`); full-attention layers: paged K and V."""
    states = state_specs(cfg)
    return [StateSlots(tuple(StateArray(s.shape, s.dtype, s.axes) for s in states[i])) if i in states
            else AttentionKV(cfg.num_kv_heads, cfg.head_dim) for i in range(cfg.num_layers)]


def gated_attention(layer: HybridLayer, x, cos, sin, kv, batch: Batch, cfg: ModelConfig, ops: ModelOps):
    T = x.shape[0]
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    fused = None
    if layer.wqkv is not None:
        (y,) = ops.norm_projections(x, layer.attn_norm, (layer.wqkv,), cfg.rms_norm_eps)
        qg, k, v = jnp.split(y, [2 * H * D, (2 * H + KVH) * D], axis=-1)
        # q/k norm, partial RoPE and the K/V write in one kernel (it reads the queries beside their gates in y)
        fused = ops.qkv_rope_write(y, layer.q_norm, layer.k_norm, cos, sin, kv, batch.slot_mapping, H, KVH,
                                   cfg.rms_norm_eps, gated_q=True)
    else:
        qg, k, v = ops.norm_projections(x, layer.attn_norm, (layer.wq, layer.wk, layer.wv), cfg.rms_norm_eps)
    qg = qg.reshape(T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
    if fused is not None:
        q, k_cache, v_cache = fused
    else:
        k, v = k.reshape(T, KVH, D), v.reshape(T, KVH, D)
        q, k = rms_norm(q, layer.q_norm, cfg.rms_norm_eps), rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k_cache, v_cache = write_kv(kv[0], kv[1], k, v, batch.slot_mapping, *kv[2:])
    out = ops.attention(q, k_cache, v_cache, batch, D**-0.5, *kv[2:]).reshape(T, H * D)
    return ops.out_proj(out * jax.nn.sigmoid(gate), layer.wo, x), (k_cache, v_cache, *kv[2:])


def _gated_delta_net(layer: HybridLayer, x, state, batch: Batch, info, cfg: ModelConfig, ops: ModelOps):
    T = x.shape[0]
    Hk, Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_state, rec_state = state
    c, vs = cfg.linear_conv_dim, cfg.linear_value_size
    if layer.lin_in is not None:
        (y,) = ops.norm_projections(x, layer.attn_norm, (layer.lin_in,), cfg.rms_norm_eps)
    else:
        y = jnp.concatenate(ops.norm_projections(x, layer.attn_norm, (layer.lin_qkv, layer.lin_z, layer.lin_b,
                                                                      layer.lin_a), cfg.rms_norm_eps), axis=-1)
    b, a = jnp.split(y[:, c + vs:], [Hv], axis=-1)  # q | k | v and z: the kernels below read them in place
    seq, fresh = info
    slots, qs = batch.state_slots, batch.query_start
    writes = slots if batch.state_write_slots is None else batch.state_write_slots
    # (one new row per sequence: row b is sequence b's; no drafts, so each writes the slot it reads)
    if ops.decode_step or (T == 1 and slots.shape[0] == 1):
        o, conv_state, rec_state = ops.gated_delta_decode(  # o normalised and gated
            y, conv_state, layer.conv_w, layer.a_log, layer.dt_bias, rec_state, slots, batch.positions, fresh,
            num_k_heads=Hk, key_dim=Dk, value_dim=Dv, b_col=c + vs, a_col=c + vs + Hv, z_col=c,
            norm_weight=layer.lin_norm, eps=cfg.rms_norm_eps)
    else:
        # y in place: q | k | v are its first conv_dim columns (a slice passed to a kernel is copied out first)
        mixed, conv_state = ops.causal_conv(y, conv_state, layer.conv_w, seq, qs[:-1], qs, slots, batch.positions,
                                            writes, batch.state_keep)
        if Dk == Dv:  # the kernels read q, k, v as heads of the conv output (slicing them out copies 3/4 of it)
            q, k, v, packed = mixed.reshape(T, 2 * Hk + Hv, Dk), None, None, Hk
        else:
            q, k, v = jnp.split(mixed, [Hk * Dk, 2 * Hk * Dk], axis=-1)
            q, k, v, packed = q.reshape(T, Hk, Dk), k.reshape(T, Hk, Dk), v.reshape(T, Hv, Dv), None
        beta, g = ops.delta_rule_gates(b, a, layer.a_log, layer.dt_bias)
        o, rec_state = ops.gated_delta_rule(q, k, v, g, beta, rec_state, slots, fresh, qs, x.dtype, packed, writes,
                                            batch.state_keep)
        o = ops.gated_rms_norm(o, y, layer.lin_norm, cfg.rms_norm_eps, gate_col=c)  # z read in place from y
    return ops.out_proj(o.reshape(T, Hv * Dv), layer.lin_out, x), (conv_state, rec_state)


def mlp(layer: HybridLayer, i: int, x: jax.Array, cfg: ModelConfig, ops: ModelOps, counters: jax.Array | None,
        num_real: jax.Array | None = None) -> tuple:
    """x + the layer's MLP of rms_norm(x): dense SwiGLU, or (qwen3_5_moe) routed experts plus the gated shared one
    (the step's counters passed on: with them a small step's norm, router and routing are one kernel); a MoE layer
    given `num_real` adds its expert counts (`ModelOps.moe_block`)."""
    if not cfg.is_moe_layer(i):
        return ops.mlp_block(x, layer.mlp_norm, layer.w_gate, layer.w_up, layer.w_down, cfg.rms_norm_eps), counters
    stacked = stacked_count(layer, cfg.num_experts)  # the shared expert in the experts' launches (shared_experts.py)
    return ops.moe_block(x, layer.mlp_norm, layer.router, layer.w_gate, layer.w_up, layer.w_down,
                         top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob, eps=cfg.rms_norm_eps,
                         counters=counters, num_real=num_real, stacked=stacked,
                         shared=None if stacked else (layer.ws_gate, layer.ws_up, layer.ws_down, layer.shared_gate))


def forward(
    weights: Weights,
    batch: Batch,
    kv_cache: tuple[tuple[jax.Array, jax.Array], ...],
    cfg: ModelConfig,
    ops: ModelOps = REFERENCE_OPS,
    aux_layers: tuple[int, ...] = (),
    expert_load: bool = False,
):
    """One step over a flattened ragged batch. `kv_cache[i]` is layer i's (k, v) pages or, for a linear
    layer, its (conv, recurrent) state pools. Returns (logits [N, vocab] float32, the updated cache), and with
    `aux_layers` (static layer boundaries, as `base.decoder_forward`'s; an MTP head's is `num_layers`, the last
    layer's output before the final norm) the residual stream there [T, len(aux_layers) * hidden] too, with
    `expert_load` the MoE layers' expert counts last (as `base.decoder_forward`'s)."""
    x = ops.embed(weights.embed, batch.input_ids, cfg.vocab_size)  # [T, hidden]
    cos, sin = rope_cos_sin(batch.positions, cfg, x.dtype)
    qs = batch.query_start
    fresh = batch.seq_lens - (qs[1:] - qs[:-1]) == 0  # [B] first new token at position 0 (or padding)
    info = (ops.token_sequences(qs, x.shape[0]), fresh)
    new_cache, captured, loads = [], {}, []
    counters = ops.step_counters(x.shape[0]) if cfg.num_experts else None  # (only the MoE front end takes them)
    record = {"num_real": base.real_tokens(batch)} if expert_load else {}
    for i, (layer, cache) in enumerate(zip(weights.layers, kv_cache, strict=True)):
        if i in aux_layers:
            captured[i] = x
        if cfg.is_linear_layer(i):
            x, cache = _gated_delta_net(layer, x, cache, batch, info, cfg, ops)
        else:
            x, cache = gated_attention(layer, x, cos, sin, cache, batch, cfg, ops)
        x, counters, *load = mlp(layer, i, x, cfg, ops, counters, **record)
        loads += load
        new_cache.append(cache)
    captured[cfg.num_layers] = x
    logits = lm_head_logits(weights, x, batch, cfg, ops)
    aux = (jnp.concatenate([captured[i] for i in aux_layers], axis=-1),) if aux_layers else ()
    return logits, tuple(new_cache), *aux, *base.expert_load_output(loads, cfg, expert_load)

