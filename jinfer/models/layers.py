"""Building blocks of the decoders: RMSNorm, RoPE, SwiGLU MLP, the mixture-of-experts MLP and paged KV
writes. All are pure functions of arrays. (Kernels are chosen in jinfer/ops/.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config.model import ModelConfig, rope_inv_freq
from jinfer.models.fp8 import dense


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back before the weight, as HF Llama/Qwen do."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for the given positions: each [T, rotary_dim] (head_dim unless partial RoPE), in the
    activation dtype."""
    inv_freq = jnp.asarray(np.asarray(rope_inv_freq(cfg), np.float32))  # [D/2], a compile-time constant
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [T, heads, D]; cos/sin: [T, R]. With R < D (partial RoPE) only the
    first R dims of each head rotate; the rest pass through."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """silu(x @ gate) * (x @ up): the SwiGLU MLP's activation [T, I] (FP8 weights dequantized first)."""
    return jax.nn.silu(x @ dense(w_gate, x.dtype)) * (x @ dense(w_up, x.dtype))


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)). x: [T, hidden]; w_gate/w_up: [hidden, I]; w_down: [I, hidden]."""
    return swiglu(x, w_gate, w_up) @ dense(w_down, x.dtype)


def moe_mlp(x: jax.Array, logits: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, top_k: int,
            renormalize: bool, first: jax.Array | None = None,
            routed: tuple[jax.Array, jax.Array] | None = None, return_ids: bool = False):
    """Mixture of SwiGLU experts in plain jnp (XLA): HF's routing, the (token, slot) pairs sorted by
    expert, two `lax.ragged_dot`s, then each token's k outputs weighted and summed.

    x: [T, hidden]; logits: [T, E] router logits; w_gate/w_up: [E', hidden, I]; w_down: [E', I, hidden].
    `first` (expert parallelism): the weights are experts [first, first + E') of the E; only the pairs
    routed to them are computed (the others sort last, outside every group) and summed. `routed`: (weights, ids)
    [T, k] each, already routed (`grouped_topk_routing`); `logits` is then unused. `return_ids`: return (out, the
    routed expert ids [T, k]) (the expert-load recorder's).
    """
    tokens, hidden = x.shape
    count = w_gate.shape[0]
    # FP8 experts (jinfer/models/fp8.py) dequantized whole: the reference path (the Pallas grouped GEMMs read FP8)
    w_gate, w_up, w_down = (dense(w, x.dtype) for w in (w_gate, w_up, w_down))
    from pallas_kernels.moe.moe_routing import topk_routing  # (not at import: Pallas is only needed to trace)

    weights, ids = routed if routed is not None else topk_routing(logits, top_k, renormalize)  # [T, k] each
    flat = ids.reshape(-1)
    if first is not None:
        flat = flat - first
        mine = (flat >= 0) & (flat < count)
        flat = jnp.where(mine, flat, count)  # other devices' pairs: past the last group
    order = jnp.argsort(flat, stable=True)  # pairs grouped by expert
    sizes = jnp.bincount(flat, length=count).astype(jnp.int32)
    xs = x[order // top_k]  # [T*k, hidden]
    g = jax.lax.ragged_dot(xs, w_gate, sizes, preferred_element_type=jnp.float32)
    u = jax.lax.ragged_dot(xs, w_up, sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    y = jax.lax.ragged_dot(h, w_down, sizes, preferred_element_type=jnp.float32)  # [T*k, hidden]
    y = y * weights.reshape(-1)[order][:, None]
    if first is not None:  # rows past the groups are not defined by ragged_dot
        y = jnp.where(mine[order][:, None], y, 0.0)
    out = jnp.zeros((tokens * top_k, hidden), jnp.float32).at[order].set(y, unique_indices=True)  # a permutation
    out = out.reshape(tokens, top_k, hidden).sum(axis=1).astype(x.dtype)
    return (out, ids) if return_ids else out


def grouped_topk_routing(logits: jax.Array, bias: jax.Array | None, *, top_k: int, n_group: int, topk_group: int,
                         sigmoid: bool, renormalize: bool, scaling: float) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's routing (HF DeepseekV2TopkRouter / DeepseekV3TopkRouter): logits [T, E] float32 -> (weights
    float32, expert ids int32), [T, k] each.

    Scores are the softmax (V2) or the sigmoid (V3) of the logits; the choice adds `bias` (V3's
    e_score_correction_bias) and keeps only the best `topk_group` of `n_group` groups of experts (a group scored by
    its best expert (softmax) or its best two (sigmoid)); the weights are the chosen experts' scores, renormalised
    when `renormalize`, times `scaling`.
    """
    tokens, experts = logits.shape
    scores = jax.nn.sigmoid(logits) if sigmoid else jax.nn.softmax(logits, axis=-1)  # [T, E]
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if n_group > 1:
        grouped = choice.reshape(tokens, n_group, experts // n_group)
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1) if sigmoid else grouped.max(-1)  # [T, G]
        kept = jax.lax.top_k(group_scores, topk_group)[1]  # [T, topk_group]
        keep = jnp.zeros((tokens, n_group), bool).at[jnp.arange(tokens)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, experts // n_group, axis=1), choice, -jnp.inf)
    ids = jax.lax.top_k(choice, top_k)[1]  # [T, k]
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scaling, ids.astype(jnp.int32)


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array,
    k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' K/V into their flat slots; padding tokens (slot < 0) go to page 0.

    k_cache/v_cache: [num_pages, page_size, KVH, D]; k/v: [T, KVH, D]; slot_mapping: [T]. An FP8 cache's rows are
    quantized with its scales k_scale / v_scale [KVH] (`pallas_kernels.kv_fp8.quantize_kv`).
    Page 0 is reserved (never holds a sequence's tokens), so padding writes land there instead of
    being dropped: every index is in bounds and the scatter needs no bounds handling. The other slots are
    unique (each token its own), and what page 0 holds is never read, so the scatter is declared with unique
    indices: plain stores instead of XLA's atomic compare-and-swap loop per element.
    """
    num_pages, page_size, kvh, d = k_cache.shape
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, 0, slot_mapping)
    from pallas_kernels.kv_fp8 import quantize_kv  # (plain jnp; traced, never imported by a warm start)

    k = quantize_kv(k, None if k_scale is None else k_scale[:, None], k_cache.dtype)
    v = quantize_kv(v, None if v_scale is None else v_scale[:, None], v_cache.dtype)
    k_flat, v_flat = k_cache.reshape(num_slots, kvh, d), v_cache.reshape(num_slots, kvh, d)
    k_flat = k_flat.at[slots].set(k, mode="promise_in_bounds", unique_indices=True)
    v_flat = v_flat.at[slots].set(v, mode="promise_in_bounds", unique_indices=True)
    return k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)
