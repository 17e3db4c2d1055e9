"""The device cache laid out from the model's per-layer cache spec (`registry.cache_spec`, `cache/spec.py`):
its bytes per page and per state slot (the engine sizes the pools from them) and its zero-filled arrays.

The cache is a tuple with one entry per layer: the layer spec's arrays, e.g. (k, v) pages of an attention
layer or the state pools of a linear-attention layer. Page 0 and state slot 0 are reserved (padding).
"""

from __future__ import annotations

from jax.sharding import Mesh

from jinfer.cache.spec import LayerCacheSpec
from jinfer.config.model import ModelConfig
from jinfer.models.registry import cache_spec


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype, tp: int = 1) -> int:
    """Bytes one page takes on each device of a `tp`-way mesh, over the paged layers."""
    return sum(spec.page_bytes(page_size, dtype, tp) for spec in cache_spec(cfg))


def state_bytes_per_slot(cfg: ModelConfig, dtype) -> int:
    """Bytes one sequence's state slot takes over all layers with a per-sequence state (0 for most models)."""
    return sum(spec.slot_bytes(dtype) for spec in cache_spec(cfg))


def slot_layers(specs: list[LayerCacheSpec]) -> frozenset[int]:
    """The layers whose cache is indexed by state slot, not by page."""
    return frozenset(i for i, spec in enumerate(specs) if not spec.paged)


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh, num_state_slots: int = 0):
    """Per layer: its spec's zero-filled arrays (attention: (k, v) pages sharded by kv head; a layer with a
    per-sequence state: one pool of `num_state_slots` slots per state array, replicated over the mesh)."""
    specs = cache_spec(cfg)
    if (n := len(slot_layers(specs))) and num_state_slots < 2:
        raise ValueError(f"num_state_slots={num_state_slots}: this model keeps a state per sequence in "
                         f"{n} layers and needs >= 2 slots (slot 0 is reserved)")
    return tuple(spec.arrays(num_pages, page_size, num_state_slots, dtype, mesh) for spec in specs)
