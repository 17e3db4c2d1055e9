"""The attention block's small ops between the q|k|v projection and the attention kernel, in one kernel:
per-head RMSNorm of q and k (Qwen3's q_norm / k_norm; optional), rotate-half RoPE of q and k (of their first
R dims: partial RoPE, Qwen3.5), and the new K/V rows written into the paged cache in place. Qwen3.5's gated
attention projects each head's query next to its output gate (`gated_q`): the kernel reads the queries
where they are and leaves the gates to the caller.

In XLA these are ~8 kernels per layer at batch-1 decode (two norm reductions, their multiplies, the
RoPE concatenate and multiplies, two cache updates), each moving a few KB: ~1.3 us apiece of launch
latency inside the CUDA graph. Here one program handles one (token, head): q heads h < H write the
rotated q; programs H.. handle kv head j = h - H, writing its normed, rotated k row and its v row to
slot `slot_mapping[t]` of the cache (padding tokens, slot < 0, write nothing).

Cache layout (vLLM/flash): `[num_pages, page_size, num_kv_heads, head_dim]`; slot s is page
s // page_size, row s % page_size. The caches are aliased to the outputs, so under jit with a donated
cache the write is in place. An FP8 cache (float8_e4m3fn, `k_scale` / `v_scale` per kv head) gets its rows
quantized as they are written (`common.quantize_kv`).

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_fp8 import check_kv_scales, is_fp8, quantize_kv


def _kernel(qkv_ref, cos_ref, sin_ref, slot_ref, qw_ref, kw_ref, _k_in, _v_in, *refs,
            num_heads: int, eps: float, qk_norm: bool, page_size: int, q_rows: int, fp8: bool):
    # refs: FP8: ks_ref, vs_ref [KVH] fp32 (whole); then q_ref [D] (this (token, head)'s row), k_ref / v_ref (the
    # caches)
    ks_ref, vs_ref, q_ref, k_ref, v_ref = refs if fp8 else (None, None, *refs)
    h = pl.program_id(1)
    dim = qkv_ref.shape[-1]
    rotary = cos_ref.shape[-1]  # < dim: partial RoPE, the first `rotary` dims of each head rotate
    half = rotary // 2
    lo, hi, whole = pl.ds(0, half), pl.ds(half, half), pl.ds(0, dim)
    f32 = jnp.float32
    cos1, cos2 = cos_ref[lo].astype(f32), cos_ref[hi].astype(f32)
    sin1, sin2 = sin_ref[lo].astype(f32), sin_ref[hi].astype(f32)
    passing = jnp.arange(dim, dtype=jnp.int32) >= rotary  # the dims RoPE leaves alone (none without partial RoPE)

    def norm_rope(r, w_ref):
        """Row r of qkv [D] -> (the rotated halves of its first `rotary` dims, the whole normed row or None),
        the norm rounded to the activation dtype as HF does."""
        dtype = qkv_ref.dtype
        x1, x2 = qkv_ref[r, lo].astype(f32), qkv_ref[r, hi].astype(f32)
        full = qkv_ref[r, whole].astype(f32) if rotary < dim else None
        if qk_norm:
            ss = jnp.sum(full * full) if full is not None else jnp.sum(x1 * x1) + jnp.sum(x2 * x2)
            inv = jax.lax.rsqrt(ss / dim + eps)
            x1 = (x1 * inv).astype(dtype).astype(f32) * w_ref[lo].astype(f32)
            x2 = (x2 * inv).astype(dtype).astype(f32) * w_ref[hi].astype(f32)
            if full is not None:
                full = (full * inv).astype(dtype).astype(f32) * w_ref[whole].astype(f32)
        o1, o2 = (x1 * cos1 - x2 * sin1).astype(dtype), (x2 * cos2 + x1 * sin2).astype(dtype)
        return o1, o2, None if full is None else full.astype(dtype)

    def put(ref, at, o1, o2, full, scale=None):  # ref[*at, :] is the [D] row written (FP8: divided by `scale`)
        if full is not None:  # the passing dims, masked: no two stores of the program overlap
            plgpu.store(ref.at[(*at, whole)], quantize_kv(full, scale, ref.dtype), mask=passing)
        ref[(*at, lo)] = quantize_kv(o1, scale, ref.dtype)
        ref[(*at, hi)] = quantize_kv(o2, scale, ref.dtype)

    @pl.when(h < num_heads)
    def _q():
        put(q_ref, (), *norm_rope(h * (q_rows // num_heads), qw_ref))

    slot = slot_ref[0]

    @pl.when((h >= num_heads) & (slot >= 0))
    def _kv():
        j = h - num_heads
        kv_heads = k_ref.shape[2]
        page, row = slot // page_size, slot % page_size
        put(k_ref, (page, row, j), *norm_rope(q_rows + j, kw_ref), ks_ref[j] if fp8 else None)
        v_ref[page, row, j, whole] = quantize_kv(qkv_ref[q_rows + kv_heads + j, whole], vs_ref[j] if fp8 else None,
                                                 v_ref.dtype)


def check_supported(qkv_width: int, num_heads: int, num_kv_heads: int, head_dim: int, *, gated_q: bool = False,
                    rotary_dim: int | None = None) -> str | None:
    """Why the kernel cannot take these shapes, or None."""
    q_rows = (2 if gated_q else 1) * num_heads
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if qkv_width != (q_rows + 2 * num_kv_heads) * head_dim:
        return f"q|k|v width {qkv_width} is not ({'2 x ' if gated_q else ''}heads + 2 kv heads) x head_dim"
    if head_dim < 4 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two >= 4 (Triton block shapes)"
    if rotary_dim < 4 or rotary_dim & (rotary_dim - 1) or rotary_dim > head_dim:
        return f"rotary_dim {rotary_dim} is not a power of two in [4, head_dim] (Triton block shapes)"
    return None


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "gated_q", "interpret"))
def qkv_rope_write(qkv: jax.Array, cos: jax.Array, sin: jax.Array, slot_mapping: jax.Array,
                   q_norm: jax.Array | None, k_norm: jax.Array | None, k_cache: jax.Array, v_cache: jax.Array,
                   k_scale: jax.Array | None = None, v_scale: jax.Array | None = None, *,
                   num_heads: int, num_kv_heads: int, eps: float = 1e-6, gated_q: bool = False,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q|k|v -> (q [T, H, D] normed and rotated, k_cache, v_cache with the new rows written).

    qkv: [T, (H + 2 KVH) * D], the fused projection's output; with `gated_q` (Qwen3.5's gated attention)
    [T, (2 H + 2 KVH) * D], each head's query followed by its output gate (the gate is left to the caller);
    cos/sin: [T, R] (rotate-half tables of the tokens' positions; R < D: partial RoPE, the first R dims of
    each head rotate); slot_mapping: int32 [T], < 0 for padding; q_norm/k_norm: [D] per-head RMSNorm
    weights, or both None (no q/k norm); caches [num_pages, page_size, KVH, D]; k_scale / v_scale: float32 [KVH]
    for a float8_e4m3fn cache, else None.
    """
    tokens, width = qkv.shape
    head_dim = k_cache.shape[-1]
    why = check_supported(width, num_heads, num_kv_heads, head_dim, gated_q=gated_q, rotary_dim=cos.shape[-1])
    if why is not None:
        raise ValueError(why)
    if k_cache.shape[2] != num_kv_heads:
        raise ValueError(f"k_cache has {k_cache.shape[2]} kv heads, expected {num_kv_heads}")
    check_kv_scales(k_cache, k_scale, v_scale)
    fp8 = is_fp8(k_cache.dtype)
    scale_args = [k_scale, v_scale] if fp8 else []
    qk_norm = q_norm is not None
    if not qk_norm:
        q_norm = k_norm = jnp.ones((head_dim,), qkv.dtype)
    q_rows = (2 if gated_q else 1) * num_heads
    rows = qkv.reshape(tokens, q_rows + 2 * num_kv_heads, head_dim)  # free reshape
    slots = slot_mapping.astype(jnp.int32).reshape(tokens, 1)
    kernel = functools.partial(_kernel, num_heads=num_heads, eps=eps, qk_norm=qk_norm,
                               page_size=k_cache.shape[1], q_rows=q_rows, fp8=fp8)
    per_token = lambda t, h: (t, 0)  # noqa: E731
    whole = pl.no_block_spec
    rotary = cos.shape[-1]
    q, k_cache, v_cache = pl.pallas_call(
        kernel,
        grid=(tokens, num_heads + num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, q_rows + 2 * num_kv_heads, head_dim), lambda t, h: (t, 0, 0)),
            pl.BlockSpec((None, rotary), per_token),
            pl.BlockSpec((None, rotary), per_token),
            pl.BlockSpec((None, 1), per_token),
            pl.BlockSpec((head_dim,), lambda t, h: (0,)),
            pl.BlockSpec((head_dim,), lambda t, h: (0,)),
            whole,
            whole,
            *[whole] * len(scale_args),
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
        name="qkv_rope_write" + ("_fp8" if fp8 else ""),
    )(rows, cos, sin, slots, q_norm, k_norm, k_cache, v_cache, *scale_args)
    return q, k_cache, v_cache


def qkv_rope_write_reference(qkv, cos, sin, slot_mapping, q_norm, k_norm, k_cache, v_cache, k_scale=None,
                             v_scale=None, *, num_heads: int, num_kv_heads: int, eps: float = 1e-6,
                             gated_q: bool = False):
    """Plain jnp, the same contract, computed as HF does (norm in float32, the rest in the input dtype)."""
    tokens = qkv.shape[0]
    d = k_cache.shape[-1]
    r = cos.shape[-1]
    qw = (2 if gated_q else 1) * num_heads * d
    q, k, v = jnp.split(qkv, [qw, qw + num_kv_heads * d], axis=-1)
    q = q.reshape(tokens, num_heads, -1)[..., :d]  # gated: each head's query, then its gate (dropped)
    k, v = k.reshape(tokens, num_kv_heads, d), v.reshape(tokens, num_kv_heads, d)

    def norm(x, w):
        xf = x.astype(jnp.float32)
        return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)

    def rope(x):  # the first r dims of each head rotate (partial RoPE when r < d)
        xr = x[..., :r]
        rotated = jnp.concatenate([-xr[..., r // 2:], xr[..., :r // 2]], axis=-1)
        return jnp.concatenate([xr * cos[:, None, :] + rotated * sin[:, None, :], x[..., r:]], axis=-1)

    if q_norm is not None:
        q, k = norm(q, q_norm), norm(k, k_norm)
    q, k = rope(q), rope(k)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = jnp.where(keep, slot_mapping, num_slots)  # padding: out of bounds, dropped
    k = quantize_kv(k, None if k_scale is None else k_scale[:, None], k_cache.dtype)
    v = quantize_kv(v, None if v_scale is None else v_scale[:, None], v_cache.dtype)
    kf = k_cache.reshape(num_slots, num_kv_heads, d).at[slots].set(k, mode="drop")
    vf = v_cache.reshape(num_slots, num_kv_heads, d).at[slots].set(v, mode="drop")
    return q, kf.reshape(k_cache.shape), vf.reshape(v_cache.shape)
