"""Gated RMSNorm (Gated DeltaNet's output norm): per head, weight * rms_norm(x) * silu(gate).

x, gate: [..., D]; weight: [D]. HF's `Qwen3_5RMSNormGated` rounding: the normalised value in x's dtype
times the weight, then times silu(gate) in float32, cast back to x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gated_rms_norm_reference(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    h = weight * xf.astype(x.dtype)
    return (h.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
