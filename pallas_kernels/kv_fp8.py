"""The FP8 KV cache's number format, shared by the kernels that read and write it and by the engine's jnp paths: plain
jnp, no Pallas (the engine's modules import it without the Pallas machinery).

An FP8 cache stores float8_e4m3fn values of x / scale, clipped to the format's largest finite value, with a float32
scale per kv head beside the pages; readers multiply by the scale in fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KV_FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(KV_FP8_DTYPE).max)  # 448


def is_fp8(dtype) -> bool:
    """Whether a cache of this dtype holds FP8 values (and scales)."""
    return jnp.dtype(dtype) == jnp.dtype(KV_FP8_DTYPE)


def quantize_kv(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """x in the cache's `dtype`: FP8, x / scale (in fp32; `scale` broadcasts against x) clipped to +-FP8_MAX
    (e4m3 has no infinity: an overflow would be NaN); any other dtype, x cast."""
    if not is_fp8(dtype):
        return x.astype(dtype)
    y = x.astype(jnp.float32) / scale
    return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(dtype)


def dequantize_kv(x: jax.Array, scale: jax.Array | None, dtype) -> jax.Array:
    """Cache values in `dtype`: FP8 ones times their scale (in fp32); others as they are."""
    if not is_fp8(x.dtype):
        return x
    return (x.astype(jnp.float32) * scale).astype(dtype)


def check_kv_scales(cache: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None) -> None:
    """An FP8 cache `[..., kv_heads, head_dim]` comes with float32 k_scale and v_scale `[kv_heads]`; others without."""
    if not is_fp8(cache.dtype):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale are for an FP8 cache, not {cache.dtype}")
        return
    heads = cache.shape[-2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.shape != (heads,) or s.dtype != jnp.float32:
            raise ValueError(f"an FP8 cache needs {name} float32 [{heads}] (one per kv head), got "
                             f"{None if s is None else (s.shape, s.dtype)}")
