"""The device cache laid out from the model's per-layer cache spec (`registry.cache_spec`, `cache/spec.py`):
its bytes per page and per state slot (the engine sizes the pools from them) and its zero-filled arrays.

The cache is a tuple with one entry per layer: the layer spec's arrays, e.g. (k, v) pages of an attention
layer ((k, v, k_scale, v_scale) in FP8) or the state pools of a linear-attention layer. Page 0 and state slot 0
are reserved (padding). The paged layers take the KV dtype (`kv_cache_dtype`), the state pools the model's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jinfer.cache.spec import AttentionKV, LatentKV, LayerCacheSpec
from jinfer.config.model import ModelConfig
from jinfer.models.fp8 import FP8
from jinfer.models.registry import cache_spec
from jinfer.parallel.mesh import kv_heads_total


def kv_cache_bytes_per_page(cfg: ModelConfig, page_size: int, dtype, tp: int = 1) -> int:
    """Bytes one page takes on each device of a `tp`-way mesh, over the paged layers (`dtype`: the KV dtype; FP8's
    scales are per layer, not per page)."""
    return sum(spec.page_bytes(page_size, dtype, tp) for spec in cache_spec(cfg))


def state_bytes_per_slot(cfg: ModelConfig, dtype, tp: int = 1) -> int:
    """Bytes one sequence's state slot takes over all layers with a per-sequence state (0 for most models), on each
    device of a `tp`-way mesh."""
    return sum(spec.slot_bytes(dtype, tp) for spec in cache_spec(cfg))


def slot_layers(specs: list[LayerCacheSpec]) -> frozenset[int]:
    """The layers whose cache is indexed by state slot, not by page."""
    return frozenset(i for i, spec in enumerate(specs) if not spec.paged)


def check_kv_dtype(cfg: ModelConfig, kv_dtype) -> None:
    """ValueError naming kv_cache_dtype where the model's cache cannot be kept in `kv_dtype`: FP8 needs attention
    layers (a latent MLA cache is not supported in FP8)."""
    if jnp.dtype(kv_dtype) != FP8:
        return
    specs = cache_spec(cfg)
    if any(isinstance(s, LatentKV) for s in specs):
        raise ValueError(f"kv_cache_dtype='fp8' is not supported for {cfg.architecture}'s latent (MLA) KV cache: "
                         "use 'auto'")
    if not any(isinstance(s, AttentionKV) for s in specs):
        raise ValueError(f"kv_cache_dtype='fp8': {cfg.architecture} has no attention layer's KV to keep in FP8")


def init_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, mesh: Mesh, num_state_slots: int = 0,
                  kv_dtype=None, kv_scales: dict[int, tuple[np.ndarray, np.ndarray]] | None = None):
    """Per layer: its spec's zero-filled arrays (attention: (k, v) pages sharded by kv head; a layer with a
    per-sequence state: one pool of `num_state_slots` slots per state array, split by heads as its layer). `kv_dtype`
    (default `dtype`): the pages' dtype. FP8 (`check_kv_dtype`): each attention layer's k_scale and v_scale, 1.0
    or, for a layer in `kv_scales`, its (k_scale, v_scale) [num_kv_heads] (the checkpoint's), repeated with the
    heads where the devices outnumber them."""
    specs = cache_spec(cfg)
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    check_kv_dtype(cfg, kv_dtype)
    if (n := len(slot_layers(specs))) and num_state_slots < 2:
        raise ValueError(f"num_state_slots={num_state_slots}: this model keeps a state per sequence in "
                         f"{n} layers and needs >= 2 slots (slot 0 is reserved)")
    cache = []
    for i, spec in enumerate(specs):
        arrays = spec.arrays(num_pages, page_size, num_state_slots, kv_dtype if spec.paged else dtype, mesh)
        if kv_scales and i in kv_scales and len(arrays) == 4:
            repeat = kv_heads_total(spec, mesh.size) // spec.num_kv_heads
            arrays = (*arrays[:2], *(jax.device_put(np.repeat(np.asarray(s, np.float32), repeat), a.sharding)
                                     for s, a in zip(kv_scales[i], arrays[2:], strict=True)))
        cache.append(arrays)
    return tuple(cache)
