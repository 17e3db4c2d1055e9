"""What the gated delta rule's kernels and references share (gated_delta_rule.py's recurrent kernel, the chunked
form, the intra-chunk kernel, the fused decode step): argument checks, the packed-heads views, q/k preparation, the
rows' sequences and the token-by-token reference. See gated_delta_rule.py for the rule and the layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import search_right

L2_EPS = 1e-6  # HF / flash-linear-attention's l2norm epsilon


def check_shapes(q, k, v, g, beta, states, *, min_dim: int = 1) -> tuple[int, int, int]:
    """The kernels' argument checks (ValueError naming what is wrong); returns (Hv, Dk, Dv)."""
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, hv) or beta.shape != (T, hv):
        raise ValueError(f"q/k must be [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv]: {q.shape=} {k.shape=} "
                         f"{v.shape=} {g.shape=} {beta.shape=}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of q/k heads ({hk})")
    if states.shape[1:] != (hv, dk, dv) or states.dtype != jnp.float32:
        raise ValueError(f"states must be float32 [slots, {hv}, {dk}, {dv}], got {states.shape} {states.dtype}")
    if dk & (dk - 1) or dv & (dv - 1) or min(dk, dv) < min_dim:
        raise ValueError(f"key_dim={dk} and value_dim={dv} must be powers of two >= {min_dim}")
    return hv, dk, dv


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis (float32), as HF's `l2norm`."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def token_sequences(query_start: jax.Array, num_tokens: int) -> jax.Array:
    """[T] the sequence of each row; B (one past the last) for padding rows."""
    return search_right(query_start[1:], jnp.arange(num_tokens, dtype=jnp.int32)).astype(jnp.int32)


def head_views(q, k, v, packed_k_heads: int | None):
    """q / k / v as the kernels take them, and the head offsets each reads at: as given (offsets 0); or, with
    packed_k_heads = Hk, q is one [T, 2 Hk + Hv, D] array holding the q heads, then the k heads, then the v heads
    (Gated DeltaNet's conv output reshaped for free when Dk = Dv) and k, v are None: the one array is passed as
    all three operands, so no slice of it is copied out before the kernel."""
    if packed_k_heads is None:
        return (q, k, v), (0, 0, 0)
    _check_packed(q, k, v, packed_k_heads)
    hk = packed_k_heads
    return (q, q, q), (0, hk, 2 * hk)


def _check_packed(q, k, v, hk: int) -> None:
    if k is not None or v is not None or len(q.shape) != 3 or q.shape[1] <= 2 * hk:
        raise ValueError(f"packed q|k|v: q must be [T, 2 Hk + Hv, D] with Hk = {hk} heads of q and k first, and "
                         f"k = v = None; got q {q.shape}, k {None if k is None else k.shape}")


def head_shapes(q, k, v, packed_k_heads: int | None):
    """The shapes of q, k, v ([T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv]) whether packed (`head_views`) or not."""
    if packed_k_heads is None:
        return q, k, v
    _check_packed(q, k, v, packed_k_heads)
    (T, H, D), hk = q.shape, packed_k_heads
    return (jax.ShapeDtypeStruct((T, hk, D), q.dtype), jax.ShapeDtypeStruct((T, hk, D), q.dtype),
            jax.ShapeDtypeStruct((T, H - 2 * hk, D), q.dtype))


def unpack_heads(q, k, v, packed_k_heads: int | None):
    """q, k, v as three arrays (slices of a packed one: copies; for the jnp references)."""
    if packed_k_heads is None:
        return q, k, v
    hk = packed_k_heads
    return q[:, :hk], q[:, hk:2 * hk], q[:, 2 * hk:]


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
                        states: jax.Array, slots: jax.Array, fresh: jax.Array, query_start: jax.Array,
                        write_slots: jax.Array | None = None, keep: jax.Array | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """The rule token by token (a `lax.scan` over the T rows) in float32. Returns (o [T, Hv, Dv] float32,
    the updated states pool). write_slots, keep: as the recurrent kernel's (gated_delta_rule.py)."""
    T, B = q.shape[0], slots.shape[0]
    qh, kh = prepare_qk(q, k, v.shape[1])
    seq = token_sequences(query_start, T)
    first = jnp.arange(T) == query_start[jnp.minimum(seq, B)]  # the first row of its sequence (padding: any)
    init = initial_states(states, slots, fresh)
    init = jnp.concatenate([init, jnp.zeros_like(init[:1])])  # row B: the padding rows' scratch state
    keep = jnp.zeros_like(slots) if keep is None else keep
    kept_row = (jnp.arange(T) - query_start[jnp.minimum(seq, B)]) < jnp.concatenate([keep, jnp.zeros(1, keep.dtype)])[
        jnp.minimum(seq, B)]  # [T] a row within its sequence's first keep rows

    def step(carry, xs):
        s, finals, kept = carry
        q_t, k_t, v_t, g_t, b_t, seq_t, first_t, kept_t = xs
        s = jnp.where(first_t, init[seq_t], s)  # [Hv, Dk, Dv]
        s = s * jnp.exp(g_t)[:, None, None]
        kv_mem = jnp.einsum("hk,hkv->hv", k_t, s)
        delta = (v_t - kv_mem) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        o_t = jnp.einsum("hk,hkv->hv", q_t, s)
        finals = jax.lax.dynamic_update_index_in_dim(finals, s, seq_t, 0)  # the last row of a sequence wins
        kept = jnp.where(kept_t, jax.lax.dynamic_update_index_in_dim(kept, s, seq_t, 0), kept)
        return (s, finals, kept), o_t

    xs = (qh, kh, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), seq, first, kept_row)
    (_, finals, kept), o = jax.lax.scan(step, (init[0], init, init), xs)
    # the kept states first (a sequence keeping none writes its read slot's own contents back), the finals after
    states = states.at[slots].set(jnp.where((keep > 0)[:, None, None, None], kept[:B], states[slots]))
    return o, states.at[slots if write_slots is None else write_slots].set(finals[:B])


def check_out(out, T: int, hv: int, dv: int) -> jax.Array:
    """The output buffer the kernels write their rows into: zeros (float32) when None."""
    if out is None:
        return jnp.zeros((T, hv, dv), jnp.float32)
    if out.shape != (T, hv, dv):
        raise ValueError(f"out must be [T, Hv, Dv] = {(T, hv, dv)}, got {out.shape}")
    return out
