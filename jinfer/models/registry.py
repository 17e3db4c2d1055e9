"""Architecture -> its family: the one table the engine, the loaders and the benchmarks go through, so that
none of them asks which family it runs.

An entry (`Family`) is the architecture's JAX-free description (`Architecture`: its HF and GGUF names and
config switches, jinfer/models/architectures.py) and its family module's functions:
`weight_specs(cfg)` (every weight described once), `assemble_weights(cfg, arrays)` (the loaders' flat dict
-> its pytree), `forward(weights, batch, kv_cache, cfg, ops)` (pure, jit-compiled by the runner),
`fuse_qkv(weights)` (the single-device fused q|k|v projection) and, if some layers keep a fixed-size state
per sequence instead of paged KV, `state_specs(cfg)` ({layer: its state arrays}; the engine sizes a pool of
state slots from it), and `cache_spec(cfg)` (one `jinfer.cache.spec.LayerCacheSpec` per layer: what the device
cache holds for it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from jinfer.cache.spec import LayerCacheSpec
from jinfer.config.model import ModelConfig
from jinfer.models import deepseek, llama, qwen3_5, qwen3_moe
from jinfer.models.architectures import ARCHITECTURES, Architecture
from jinfer.models.fp8 import kernel_layout
from jinfer.models.shared_experts import stack_shared_experts
from jinfer.models.spec import StateSpec, quantize_specs
from jinfer.ops import REFERENCE_OPS, ModelOps
from jinfer.parallel.mesh import shard_attention_weights


@dataclass(frozen=True)
class Family:
    """One architecture as the engine runs it (the functions: see the module's docstring)."""

    arch: Architecture
    weight_specs: Callable
    assemble_weights: Callable
    forward: Callable
    fuse_qkv: Callable
    cache_spec: Callable
    state_specs: Callable | None = None  # None: every layer keeps paged KV

    @classmethod
    def of(cls, name: str, module: ModuleType) -> Family:
        """Architecture `name` run by family `module`."""
        return cls(ARCHITECTURES[name], module.weight_specs, module.assemble_weights, module.forward,
                   module.fuse_qkv, module.cache_spec, getattr(module, "state_specs", None))


# Llama, Qwen2 and Qwen3 are one family: the dense decoder with the config's switches; Qwen3.5 and Qwen3.5-MoE another
FAMILIES: dict[str, Family] = {name: Family.of(name, module) for name, module in (
    ("llama", llama), ("qwen2", llama), ("qwen3", llama), ("qwen3_moe", qwen3_moe), ("qwen3_5", qwen3_5),
    ("qwen3_5_moe", qwen3_5), ("deepseek_v2", deepseek), ("deepseek_v3", deepseek))}
assert set(FAMILIES) == set(ARCHITECTURES)


def family(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.architecture]


def weight_specs(cfg: ModelConfig):
    """The family's weight specs, its linear weights marked FP8 where `cfg.quantization` asks (`quantize_specs`)."""
    return quantize_specs(family(cfg).weight_specs(cfg), cfg.quantization)


def assemble_weights(cfg: ModelConfig, arrays):
    return family(cfg).assemble_weights(cfg, arrays)


def forward(weights, batch, kv_cache, cfg: ModelConfig, ops: ModelOps = REFERENCE_OPS,
            aux_layers: tuple[int, ...] = (), expert_load: bool = False):
    """(logits, cache); with `aux_layers` (llama, qwen3_moe and deepseek: not qwen3_5) also the hidden
    states at those layer boundaries, an EAGLE-3 head's inputs; with `expert_load` (the MoE families) the MoE
    layers' expert counts i32[MoE layers, E] last (`base.decoder_forward`)."""
    extra = {"aux_layers": aux_layers} if aux_layers else {}
    if expert_load:
        if not cfg.num_experts:
            raise ValueError(f"expert_load_stats: {cfg.architecture!r} is not a mixture-of-experts model")
        extra["expert_load"] = True
    return family(cfg).forward(weights, batch, kv_cache, cfg, ops, **extra)


def moe_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """The MoE layers' indices: the rows of the forward's expert counts (`expert_load`)."""
    return tuple(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i))


def fuse_qkv(cfg: ModelConfig, weights):
    return family(cfg).fuse_qkv(weights)


def cache_spec(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """One cache description per layer (jinfer/cache/spec.py): paged KV, state slots, ..."""
    return family(cfg).cache_spec(cfg)


def shard_weights(cfg: ModelConfig, weights, mesh, fuse_qkv: bool = True, expert_parallel: bool = False):
    """The weights laid out for the mesh (`parallel.mesh.shard_attention_weights`); on one device, with `fuse_qkv`,
    the family's own fused projections; the MoE layers' shared experts stacked after the routed ones but under expert
    parallel (`shared_experts.stack_shared_experts`). The dense MLPs' and o's FP8 weights [out, in]
    (`fp8.kernel_layout`)."""
    if fuse_qkv and not (expert_parallel and mesh.size > 1) and cfg.num_experts and (
            cfg.num_shared_experts or cfg.shared_expert_intermediate_size):
        weights = stack_shared_experts(weights, cfg.num_experts)
    if mesh.size == 1:
        return kernel_layout(family(cfg).fuse_qkv(weights) if fuse_qkv else weights)
    return kernel_layout(shard_attention_weights(cfg, weights, mesh, fuse_qkv, expert_parallel))


def state_specs(cfg: ModelConfig) -> dict[int, tuple[StateSpec, ...]]:
    """{layer index: its per-sequence state arrays} for layers without paged KV; {} for most families."""
    fn = getattr(family(cfg), "state_specs", None)
    return fn(cfg) if fn is not None else {}
