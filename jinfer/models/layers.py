"""Building blocks of the dense decoder: RMSNorm, RoPE, SwiGLU MLP, paged KV writes and the
reference (plain-jnp) paged attention. All are pure functions of arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig, rope_inv_freq


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 and cast back before the weight, as HF Llama/Qwen do."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for the given positions: each [T, head_dim], in the activation dtype."""
    inv_freq = jnp.asarray(np.asarray(rope_inv_freq(cfg), np.float32))  # [D/2], a compile-time constant
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [T, D]
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF layout). x: [T, heads, D]; cos/sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """down(silu(x @ gate) * (x @ up)). x: [T, hidden]; w_gate/w_up: [hidden, I]; w_down: [I, hidden]."""
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def write_kv(
    k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new tokens' K/V into their flat slots; padding tokens (slot < 0) go to page 0.

    k_cache/v_cache: [num_pages, page_size, KVH, D]; k/v: [T, KVH, D]; slot_mapping: [T].
    Page 0 is reserved (never holds a sequence's tokens), so padding writes land there instead of
    being dropped: every index is in bounds and the scatter needs no bounds handling.
    """
    num_pages, page_size, kvh, d = k_cache.shape
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping < 0, 0, slot_mapping)
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
    k_flat, v_flat = k_cache.reshape(num_slots, kvh, d), v_cache.reshape(num_slots, kvh, d)
    k_flat = k_flat.at[slots].set(k, mode="promise_in_bounds")
    v_flat = v_flat.at[slots].set(v, mode="promise_in_bounds")
    return k_flat.reshape(k_cache.shape), v_flat.reshape(v_cache.shape)


def token_seq_ids(query_start: jax.Array, num_tokens: int) -> jax.Array:
    """Index of the sequence each flattened token belongs to ([T]; padding tokens map to the last seq)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(query_start[1:], t, side="right").astype(jnp.int32)
    return jnp.minimum(seq, query_start.shape[0] - 2)


def paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    query_start: jax.Array,
    page_table: jax.Array,
    scale: float,
) -> jax.Array:
    """Causal attention of each new token over its sequence's paged context, in plain jnp.

    q: [T, H, D]; caches: [num_pages, page_size, KVH, D] (already holding the new tokens);
    positions: [T]; query_start: [B+1]; page_table: [B, P]. Returns [T, H, D].
    Each token gathers its own sequence's pages ([T, P*page_size, KVH, D]): simple and exact, but
    memory grows with T x context — the Pallas kernels replace this on GPU.
    """
    T, H, D = q.shape
    _, page_size, kvh, _ = k_cache.shape
    group = H // kvh
    seq = token_seq_ids(query_start, T)  # [T]
    pages = page_table[seq]  # [T, P]
    S = pages.shape[1] * page_size
    k = k_cache[pages].reshape(T, S, kvh, D)  # [T, S, KVH, D]
    v = v_cache[pages].reshape(T, S, kvh, D)
    qg = q.reshape(T, kvh, group, D)
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, k, preferred_element_type=jnp.float32) * scale
    visible = jnp.arange(S, dtype=jnp.int32)[None, :] <= positions[:, None]  # [T, S] causal within the seq
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("tkgs,tskd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(T, H, D).astype(q.dtype)
