"""The attention block's small ops between the q|k|v projection and the attention kernel, in one kernel:
per-head RMSNorm of q and k (Qwen3's q_norm / k_norm; optional), rotate-half RoPE of q and k, and the
new K/V rows written into the paged cache in place.

In XLA these are ~8 kernels per layer at batch-1 decode (two norm reductions, their multiplies, the
RoPE concatenate and multiplies, two cache updates), each moving a few KB: ~1.3 us apiece of launch
latency inside the CUDA graph. Here one program handles one (token, head): q heads h < H write the
rotated q; programs H.. handle kv head j = h - H, writing its normed, rotated k row and its v row to
slot `slot_mapping[t]` of the cache (padding tokens, slot < 0, write nothing).

Cache layout (vLLM/flash): `[num_pages, page_size, num_kv_heads, head_dim]`; slot s is page
s // page_size, row s % page_size. The caches are aliased to the outputs, so under jit with a donated
cache the write is in place.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(qkv_ref, cos_ref, sin_ref, slot_ref, qw_ref, kw_ref, _k_in, _v_in, q_ref, k_ref, v_ref, *,
            num_heads: int, eps: float, qk_norm: bool, page_size: int):
    h = pl.program_id(1)
    half = qkv_ref.shape[-1] // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    f32 = jnp.float32
    cos1, cos2 = cos_ref[lo].astype(f32), cos_ref[hi].astype(f32)
    sin1, sin2 = sin_ref[lo].astype(f32), sin_ref[hi].astype(f32)

    def norm_rope(x1, x2, w_ref):
        """x [D] as halves -> RoPE(RMSNorm(x)), the norm rounded to the activation dtype as HF does."""
        dtype = x1.dtype
        x1, x2 = x1.astype(f32), x2.astype(f32)
        if qk_norm:
            inv = jax.lax.rsqrt((jnp.sum(x1 * x1) + jnp.sum(x2 * x2)) / (2 * half) + eps)
            x1 = (x1 * inv).astype(dtype).astype(f32) * w_ref[lo].astype(f32)
            x2 = (x2 * inv).astype(dtype).astype(f32) * w_ref[hi].astype(f32)
        return (x1 * cos1 - x2 * sin1).astype(dtype), (x2 * cos2 + x1 * sin2).astype(dtype)

    @pl.when(h < num_heads)
    def _q():
        o1, o2 = norm_rope(qkv_ref[h, lo], qkv_ref[h, hi], qw_ref)
        q_ref[lo] = o1.astype(q_ref.dtype)
        q_ref[hi] = o2.astype(q_ref.dtype)

    slot = slot_ref[0]

    @pl.when((h >= num_heads) & (slot >= 0))
    def _kv():
        j = h - num_heads
        kv_heads = k_ref.shape[2]
        page, row = slot // page_size, slot % page_size
        o1, o2 = norm_rope(qkv_ref[num_heads + j, lo], qkv_ref[num_heads + j, hi], kw_ref)
        k_ref[page, row, j, lo] = o1.astype(k_ref.dtype)
        k_ref[page, row, j, hi] = o2.astype(k_ref.dtype)
        vrow = num_heads + kv_heads + j
        v_ref[page, row, j, lo] = qkv_ref[vrow, lo].astype(v_ref.dtype)
        v_ref[page, row, j, hi] = qkv_ref[vrow, hi].astype(v_ref.dtype)


def check_supported(qkv_width: int, num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why the kernel cannot take these shapes, or None."""
    if qkv_width != (num_heads + 2 * num_kv_heads) * head_dim:
        return f"q|k|v width {qkv_width} is not (heads + 2 kv heads) x head_dim"
    if head_dim < 4 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 4 (Triton block shapes)"
    return None


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "interpret"))
def qkv_rope_write(qkv: jax.Array, cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array,
                   q_norm: jax.Array | None, k_norm: jax.Array | None, k_cache: jax.Array, v_cache: jax.Array, *,
                   num_heads: int, num_kv_heads: int, eps: float = 1e-6, interpret: bool = False
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q|k|v -> (q [T, H, D] normed and rotated, k_cache, v_cache with the new rows written).

    qkv: [T, (H + 2 KVH) * D], the fused projection's output; cos/sin: [T, D] (rotate-half tables of
    the tokens' positions); slot_mapping: int32 [T], < 0 for padding; q_norm/k_norm: [D] per-head
    RMSNorm weights, or both None (no q/k norm); caches [num_pages, page_size, KVH, D].
    """
    tokens, width = qkv.shape
    head_dim = k_cache.shape[-1]
    why = check_supported(width, num_heads, num_kv_heads, head_dim)
    if why is not None:
        raise ValueError(why)
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"k_cache has {k_cache.shape[2]} kv heads, expected {num_kv_heads}")
    qk_norm = q_norm is not None
    if not qk_norm:
        q_norm = k_norm = jnp.ones((head_dim,), qkv.dtype)
    rows = qkv.reshape(tokens, num_heads + 2 * num_kv_heads, head_dim)  # free reshape
    slots = slot_mapping.astype(jnp.int32).reshape(tokens, 1)
    kernel = functools.partial(_kernel, num_heads=num_heads, eps=eps, qk_norm=qk_norm,
                               page_size=k_cache.shape[1])
    per_token = lambda t, h: (t, 0)  # noqa: E731
    whole = pl.no_block_spec
    q, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(tokens, num_heads + num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, num_heads + 2 * num_kv_heads, head_dim), lambda t, h: (t, 0, 0)),
            pl.BlockSpec((None, head_dim), per_token),
            pl.BlockSpec((None, head_dim), per_token),
            pl.BlockSpec((None, 1), per_token),
            pl.BlockSpec((head_dim,), lambda t, h: (0,)),
            pl.BlockSpec((head_dim,), lambda t, h: (0,)),
            whole,
            whole,
        ],
        out_specs=[
            pl.BlockSpec((None, None, head_dim), lambda t, h: (t, jnp.minimum(h, num_heads - 1), 0)),
            whole,
            whole,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((tokens, num_heads, head_dim), qkv.dtype),
            jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
            jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype),
        ],
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="qkv_rope_write",
    )(rows, cos, sin, slots, q_norm, k_norm, k_cache, v_cache)
    return q, k_cache, v_cache


def qkv_rope_write_reference(qkv, cos, sin, slot_mapping, q_norm, k_norm, k_cache, v_cache, *, num_heads: int,
                             num_kv_heads: int, eps: float = 1e-6):
    """Plain jnp, the same contract, computed as HF does (norm in float32, the rest in the input dtype)."""
    tokens = qkv.shape[0]
    d = k_cache.shape[-1]
    q, k, v = jnp.split(qkv, [num_heads * d, (num_heads + num_kv_heads) * d], axis=-1)
    q, k, v = q.reshape(tokens, num_heads, d), k.reshape(tokens, num_kv_heads, d), v.reshape(tokens, num_kv_heads, d)

    def norm(x, w):
        xf = x.astype(jnp.float32)
        return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)

    def rope(x):
        rotated = jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * cos[:, None, :] + rotated * sin[:, None, :]

    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    q, k = rope(q), rope(k)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = jnp.where(keep, slot_mapping, num_slots)  # padding: out of bounds, dropped
    kf = k_cache.reshape(num_slots, num_kv_heads, d).at[slots].set(k.astype(k_cache.dtype), mode="drop")
    vf = v_cache.reshape(num_slots, num_kv_heads, d).at[slots].set(v.astype(v_cache.dtype), mode="drop")
    return q, kf.reshape(k_cache.shape), vf.reshape(v_cache.shape)
