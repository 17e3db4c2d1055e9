"""Architecture -> model family module. The engine, the loaders and the benchmarks go through here and
never ask which family they run.

A family module provides `weight_specs(cfg)` (every weight described once), `assemble_weights(cfg,
arrays)` (the loaders' flat dict -> its pytree), `forward(weights, batch, kv_cache, cfg, ops)` (pure,
jit-compiled by the runner), `fuse_qkv(weights)` (the single-device fused q|k|v projection) and, if some
layers keep a fixed-size state per sequence instead of paged KV, `state_specs(cfg)` ({layer: its state
arrays}; the engine sizes a pool of state slots from it), and `cache_spec(cfg)` (one
`jinfer.cache.spec.LayerCacheSpec` per layer: what the device cache holds for it).
"""

from __future__ import annotations

from types import ModuleType

from jinfer.cache.spec import LayerCacheSpec
from jinfer.config.model import ARCHITECTURES, ModelConfig
from jinfer.models import llama, qwen3_5, qwen3_moe
from jinfer.ops import REFERENCE_OPS, ModelOps
from jinfer.models.spec import StateSpec

FAMILIES: dict[str, ModuleType] = {"llama": llama, "qwen2": llama, "qwen3": llama, "qwen3_moe": qwen3_moe,
                                 "qwen3_5": qwen3_5}
assert set(FAMILIES) == set(ARCHITECTURES)


def family(cfg: ModelConfig) -> ModuleType:
    return FAMILIES[cfg.architecture]


def weight_specs(cfg: ModelConfig):
    return family(cfg).weight_specs(cfg)


def assemble_weights(cfg: ModelConfig, arrays):
    return family(cfg).assemble_weights(cfg, arrays)


def forward(weights, batch, kv_cache, cfg: ModelConfig, ops: ModelOps = REFERENCE_OPS):
    return family(cfg).forward(weights, batch, kv_cache, cfg, ops)


def fuse_qkv(cfg: ModelConfig, weights):
    return family(cfg).fuse_qkv(weights)


def cache_spec(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """One cache description per layer (jinfer/cache/spec.py): paged KV, state slots, ..."""
    return family(cfg).cache_spec(cfg)


def state_specs(cfg: ModelConfig) -> dict[int, tuple[StateSpec, ...]]:
    """{layer index: its per-sequence state arrays} for layers without paged KV; {} for most families."""
    fn = getattr(family(cfg), "state_specs", None)
    return fn(cfg) if fn is not None else {}
