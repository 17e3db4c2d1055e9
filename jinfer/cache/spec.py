"""What each layer keeps in the device cache, described once per layer (`registry.cache_spec(cfg)`).

A model family states one `LayerCacheSpec` per layer; the cache's bytes, its device arrays and which pool
(pages or state slots) a layer's entries live in all follow from these descriptions (`jinfer/cache/layout.py`),
so the engine never asks which family it runs. Three kinds today:
- `AttentionKV`: K and V pages, `[num_pages, page_size, kv_heads, head_dim]` each, indexed by the paged
  allocator (`manager.py`); the kv heads are split over the tensor-parallel devices. In float8_e4m3fn
  (`kv_cache_dtype="fp8"`) the layer also holds k_scale and v_scale, float32 `[kv_heads]`, split like the heads
  (see `AttentionKV`);
- `LatentKV`: one paged row per token, `[num_pages, page_size, dim]` (multi-head latent attention: the K/V latent
  and the shared RoPE key, 576 values for DeepSeek-V2/V3), shared by every head, so replicated over the devices;
- `StateSlots`: fixed-size per-sequence state arrays (linear-attention layers), one pool `[num_slots, *shape]`
  per array, indexed by a sequence's state slot, split over the devices by heads (`StateArray.axes`) as the layer.
Another cache is a new subclass: its arrays per layer (`arrays`), its bytes per page and per slot, and `paged`
(which pool indexes it). A layer's arrays are indexed by page or slot on their leading axis, but for trailing 1-D
ones (FP8 scales), which are the layer's constants (`indexed_arrays`).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.models.fp8 import FP8
from jinfer.parallel.mesh import KV_AXES, kv_heads_total, logical_sharding


def indexed_arrays(layer: tuple[jax.Array, ...]) -> int:
    """How many of a layer's arrays are indexed by page or slot (the rest, 1-D, are FP8 scales)."""
    return sum(a.ndim > 1 for a in layer)


@dataclass(frozen=True)
class StateArray:
    """One array of a layer's per-sequence state: the cache holds `[num_slots, *shape]` of it. `dtype` None: the
    cache's dtype."""

    shape: tuple[int, ...]
    dtype: str | None = None
    axes: tuple[str | None, ...] | None = None  # logical axes of `shape`, split over the mesh; None: replicated

    def __post_init__(self):
        if not self.shape or any(not isinstance(n, int) or n < 1 for n in self.shape):
            raise ValueError(f"shape={self.shape!r} must be a non-empty tuple of integers >= 1")


@dataclass(frozen=True)
class LayerCacheSpec:
    """One layer's cache. `paged`: its entries are indexed by KV page (else by state slot)."""

    paged = True

    def page_bytes(self, page_size: int, dtype, tp: int) -> int:
        """Bytes one page takes on each device of a `tp`-way mesh."""
        return 0

    def slot_bytes(self, dtype, tp: int = 1) -> int:
        """Bytes one sequence's state slot takes on each device of a `tp`-way mesh."""
        return 0

    def arrays(self, num_pages: int, page_size: int, num_slots: int, dtype, mesh: Mesh) -> tuple[jax.Array, ...]:
        """The layer's zero-filled device arrays."""
        raise NotImplementedError


@dataclass(frozen=True)
class AttentionKV(LayerCacheSpec):
    """Paged K and V of an attention layer: (k, v), or in FP8 (k, v, k_scale, v_scale).

    FP8 (float8_e4m3fn, vLLM's `kv_cache_dtype="fp8"`): a value is stored as clip(x / scale, +-448) and read as its
    e4m3 value times the scale, one float32 scale per layer and kv head for K and one for V. Static scales (1.0, vLLM's
    default, or the checkpoint's `k_scale` / `v_scale`) keep the write a divide and the read free: a kernel program
    owns one kv head, so K's scale folds into the softmax's and V's multiplies the accumulator once; per-page or
    per-token scales would put a load and a multiply per element in the decode loop, and their bytes beside every page.
    Per head rather than vLLM's per tensor: a checkpoint's per-head scales are kept, a per-tensor one broadcast.
    """

    num_kv_heads: int
    head_dim: int

    def __post_init__(self):
        for name in ("num_kv_heads", "head_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer >= 1")

    def page_bytes(self, page_size: int, dtype, tp: int) -> int:
        # each device holds its share of the kv heads (all of them replicated past one head per device)
        return 2 * page_size * (kv_heads_total(self, tp) // tp) * self.head_dim * jnp.dtype(dtype).itemsize

    def arrays(self, num_pages, page_size, num_slots, dtype, mesh):
        heads = kv_heads_total(self, mesh.size)
        shape = (num_pages, page_size, heads, self.head_dim)
        zeros = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=logical_sharding(mesh, KV_AXES, shape))
        if jnp.dtype(dtype) != FP8:
            return zeros(), zeros()
        ones = jax.jit(lambda: jnp.ones((heads,), jnp.float32),
                       out_shardings=logical_sharding(mesh, KV_AXES[2:3], (heads,)))
        return zeros(), zeros(), ones(), ones()


@dataclass(frozen=True)
class LatentKV(LayerCacheSpec):
    """Paged latent rows of a multi-head latent attention layer: `[num_pages, page_size, dim]`, one array. Every
    head reads the whole row, so each device of a mesh holds all of it (the heads are split, the cache is not)."""

    dim: int

    def __post_init__(self):
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ValueError(f"dim={self.dim!r} must be an integer >= 1")

    def page_bytes(self, page_size: int, dtype, tp: int) -> int:
        return page_size * self.dim * jnp.dtype(dtype).itemsize

    def arrays(self, num_pages, page_size, num_slots, dtype, mesh):
        if jnp.dtype(dtype) == FP8:
            raise ValueError("kv_cache_dtype='fp8' is not supported for a latent (MLA) cache")
        shape = (num_pages, page_size, self.dim)
        return (jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, PartitionSpec()))(),)


@dataclass(frozen=True)
class StateSlots(LayerCacheSpec):
    """A linear-attention layer's fixed-size state per sequence (e.g. conv inputs and recurrent state)."""

    states: tuple[StateArray, ...]
    paged = False

    def __post_init__(self):
        if not self.states:
            raise ValueError("states=() must name at least one state array")

    def slot_bytes(self, dtype, tp: int = 1) -> int:
        total = 0
        for s in self.states:
            n = 1
            for d in s.shape:
                n *= d
            split = tp if s.axes is not None and any(s.axes) else 1  # (a state split by heads: its share)
            total += n * jnp.dtype(s.dtype or dtype).itemsize // split
        return total

    def arrays(self, num_pages, page_size, num_slots, dtype, mesh):
        def sharding(s):  # (a state split by heads over the mesh, as its layer's weights: `StateArray.axes`)
            if s.axes is None:
                return NamedSharding(mesh, PartitionSpec())
            return logical_sharding(mesh, (None, *s.axes), (num_slots, *s.shape))

        return tuple(jax.jit(lambda s=s: jnp.zeros((num_slots, *s.shape), s.dtype or dtype),
                             out_shardings=sharding(s))() for s in self.states)
