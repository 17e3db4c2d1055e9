"""Random weights at any config, generated directly on the device with the target sharding.

Each "normal" weight is N(0, 0.02): a counter-based hash of (element index, per-array salt) gives a
uniform number, `erf_inv` turns it into a normal one (the way jax.random.normal does). The salt
comes from (seed, the weight's position in `weight_specs` order), so the values depend only on the
seed: not on the mesh (every shard hashes global indices), the grouping below, or the device count.

Why not jax.random: threefry makes a large program per shape, which costs ~0.4 s of compile each on
an H100 (~3 s for Qwen3-4B, paid at every start since each is under the persistent cache's
threshold), while the hash is a few integer ops. And one jitted function makes a whole group of
arrays: one layer's ("layers.<i>." prefix), or all the others. Layers repeat the same shapes, so a
model costs two small compiles and one dispatch per layer.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from functools import cache

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Sharding

from jinfer.models.spec import ArrayInfo

STD = 0.02
_LAYER = re.compile(r"^(layers\.\d+)\.(.+)$")
# one array of a group: (name within the group, shape, init, sharding, its own dtype or None)
_Member = tuple[str, tuple[int, ...], str, Sharding, str | None]


def _group_of(name: str) -> tuple[str, str]:
    """'layers.3.wq' -> ('layers.3', 'wq'); 'embed' -> ('', 'embed')."""
    m = _LAYER.match(name)
    return (m.group(1), m.group(2)) if m else ("", name)


def _salt(seed: int, index: int) -> int:
    """A 32-bit salt per (seed, weight index); any Python int seed."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=4).digest(), "little")


def _normal(shape: tuple[int, ...], salt: jax.Array, dtype) -> jax.Array:
    """N(0, STD) from a hash of each element's flat index (uint32: arrays past 2^32 elements repeat)."""
    idx = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        idx = idx + lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    h = idx * jnp.uint32(0x9E3779B9) + salt  # murmur3's fmix32 of a Weyl sequence
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    h = h ^ (h >> 16)
    u = ((h >> 9).astype(jnp.float32) + 0.5) * 2.0**-22 - 1.0  # uniform in (-1, 1), exact in float32
    return (lax.erf_inv(u) * (STD * 2**0.5)).astype(dtype)


@cache
def _group_init(members: tuple[_Member, ...], dtype) -> jax.stages.Wrapped:
    """Jitted (salts [n] uint32) -> the group's arrays, each placed with its sharding."""

    def init(salts):
        out = []
        for j, (_, shape, kind, _, own) in enumerate(members):
            dt = own or dtype
            if kind == "ones":
                out.append(jnp.ones(shape, dt))
            elif kind == "zeros":
                out.append(jnp.zeros(shape, dt))
            else:
                out.append(_normal(shape, salts[j], dt))
        return tuple(out)

    return jax.jit(init, out_shardings=tuple(m[3] for m in members))


def dummy_weights(specs: dict[str, ArrayInfo], dtype, shardings: dict[str, Sharding],
                  seed: int = 0, finish: Callable | None = None) -> dict[str, jax.Array]:
    """Random arrays for every spec (same keys as `specs`), each with `shardings[name]`. `finish(name, array)`,
    where given, replaces each array as its group is made (the loader quantizes FP8 weights there, so a model whose
    bf16 weights would not fit is never whole in bf16)."""
    for spec in specs.values():
        if spec.init not in ("normal", "ones", "zeros"):
            raise ValueError(f"init={spec.init!r} of {spec.hf_name!r} must be 'normal', 'ones' or 'zeros'")
    groups: dict[str, list[tuple[int, str, str]]] = {}  # group -> [(index in specs, full name, local name)]
    for i, name in enumerate(specs):
        group, local = _group_of(name)
        groups.setdefault(group, []).append((i, name, local))
    arrays = {}
    for entries in groups.values():
        members = tuple((local, specs[name].shape, specs[name].init, shardings[name], specs[name].dtype)
                        for _, name, local in entries)
        salts = np.array([_salt(seed, i) for i, _, _ in entries], np.uint32)
        for (_, name, _), a in zip(entries, _group_init(members, dtype)(salts), strict=True):
            arrays[name] = a if finish is None else finish(name, a)
    return arrays
