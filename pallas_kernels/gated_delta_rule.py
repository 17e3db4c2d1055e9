"""Gated delta rule (Gated DeltaNet's linear attention) over a ragged batch of sequences.

Per value head, with S the [key_dim, value_dim] state and k, q L2-normalised (q also by key_dim^-0.5):

    S <- exp(g_t) * S                     (decay)
    S <- S + k_t (beta_t (v_t - k_t^T S))  (delta rule: write the correction of what S predicts for k_t)
    o_t = q_t^T S

Layout (ragged, like jinfer/models/batch.py): tokens of sequence b are rows
`query_start[b]:query_start[b + 1]` of q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv]
(float32); each q/k head serves Hv / Hk consecutive value heads (HF's repeat_interleave). Every
sequence starts from its state slot `states[slots[b]]` ([S, Hv, Dk, Dv] float32), or from zeros where
`fresh[b]` (its first token is position 0), and its final state is written back to the same slot.
Rows past `query_start[B]` are padding.

This module holds the references: `recurrent_reference` (token by token, exactly HF's
`torch_recurrent_gated_delta_rule`) and `gated_delta_rule` picks the implementation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

L2_EPS = 1e-6  # HF / flash-linear-attention's l2norm epsilon


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis (float32), as HF's `l2norm`."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def token_sequences(query_start: jax.Array, num_tokens: int) -> jax.Array:
    """[T] the sequence of each row; B (one past the last) for padding rows."""
    return jnp.searchsorted(query_start[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right").astype(jnp.int32)


def prepare_qk(q: jax.Array, k: jax.Array, num_v_heads: int) -> tuple[jax.Array, jax.Array]:
    """L2-normalise q and k (float32), scale q by key_dim^-0.5, repeat each head for its value heads."""
    rep = num_v_heads // q.shape[1]
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    return jnp.repeat(q, rep, axis=1), jnp.repeat(k, rep, axis=1)  # [T, Hv, Dk] each


def initial_states(states: jax.Array, slots: jax.Array, fresh: jax.Array) -> jax.Array:
    """[B, Hv, Dk, Dv]: each sequence's slot, zeros for sequences starting at position 0."""
    return jnp.where(fresh[:, None, None, None], 0.0, states[slots])


def recurrent_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                        states: jax.Array, slots: jax.Array, fresh: jax.Array, query_start: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
    """The rule token by token (a `lax.scan` over the T rows) in float32. Returns (o [T, Hv, Dv] float32,
    the updated states pool)."""
    T, B = q.shape[0], slots.shape[0]
    qh, kh = prepare_qk(q, k, v.shape[1])
    seq = token_sequences(query_start, T)
    first = jnp.arange(T) == query_start[jnp.minimum(seq, B)]  # the first row of its sequence (padding: any)
    init = initial_states(states, slots, fresh)
    init = jnp.concatenate([init, jnp.zeros_like(init[:1])])  # row B: the padding rows' scratch state
    finals = init

    def step(carry, xs):
        s, finals = carry
        q_t, k_t, v_t, g_t, b_t, seq_t, first_t = xs
        s = jnp.where(first_t, init[seq_t], s)  # [Hv, Dk, Dv]
        s = s * jnp.exp(g_t)[:, None, None]
        kv_mem = jnp.einsum("hk,hkv->hv", k_t, s)
        delta = (v_t - kv_mem) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        o_t = jnp.einsum("hk,hkv->hv", q_t, s)
        finals = jax.lax.dynamic_update_index_in_dim(finals, s, seq_t, 0)  # the last row of a sequence wins
        return (s, finals), o_t

    xs = (qh, kh, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), seq, first)
    (_, finals), o = jax.lax.scan(step, (init[0], finals), xs)
    return o, states.at[slots].set(finals[:B])


def gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, *, backend: str = "reference",
                     interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The rule over a ragged batch (see the module doc): (o [T, Hv, Dv] float32, updated states pool)."""
    del backend, interpret  # only the reference so far
    return recurrent_reference(q, k, v, g, beta, states, slots, fresh, query_start)
