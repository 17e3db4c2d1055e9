"""Random weights at any config, generated directly on the device with the target sharding."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jinfer.models.llama import ArrayInfo


@partial(jax.jit, static_argnames=("shape", "dtype", "init", "out_sharding"))
def _init(key, shape, dtype, init, out_sharding):
    del out_sharding  # part of the cache key; applied through jax.jit(out_shardings=...) below
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def dummy_array(key: jax.Array, spec: ArrayInfo, dtype, sharding) -> jax.Array:
    out = _init(key, spec.shape, dtype, spec.init, sharding)
    return jax.device_put(out, sharding)
