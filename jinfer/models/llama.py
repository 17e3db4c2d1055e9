"""The llama-family dense decoder (Llama, Qwen2, Qwen3): the shared decoder (base.py) with a dense SwiGLU
MLP in every layer.

The three architectures differ only by switches in `ModelConfig` that the shared attention reads:
`attention_bias` (Qwen2 q/k/v bias) and `qk_norm` (Qwen3 per-head RMSNorm on q and k before RoPE).
"""

from __future__ import annotations

import jax

from jinfer.config.model import ModelConfig
from jinfer.models.base import (
    Weights,
    assemble_weights,
    attention_specs,
    cache_spec,
    decoder_forward,
    decoder_specs,
    dense_mlp,
    fuse_qkv,
    mlp_specs,
)
from jinfer.models.batch import Batch
from jinfer.models.spec import ArrayInfo
from jinfer.ops import REFERENCE_OPS, ModelOps

__all__ = ["assemble_weights", "cache_spec", "forward", "fuse_qkv", "layer_specs", "weight_specs"]


def layer_specs(cfg: ModelConfig, i: int) -> dict[str, ArrayInfo]:
    return attention_specs(cfg, i) | mlp_specs(cfg, i)


def weight_specs(cfg: ModelConfig) -> dict[str, ArrayInfo]:
    """Every weight of the model, keyed by its path in the `Weights` pytree ("layers.3.wq")."""
    return decoder_specs(cfg, layer_specs)


def forward(
    weights: Weights,
    batch: Batch,
    kv_cache: tuple[tuple[jax.Array, jax.Array], ...],
    cfg: ModelConfig,
    ops: ModelOps = REFERENCE_OPS,
    aux_layers: tuple[int, ...] = (),
):
    """One step over a flattened ragged batch. Returns (logits [N, vocab] float32, updated kv_cache), and with
    `aux_layers` the hidden states at those layer boundaries too (`base.decoder_forward`)."""
    return decoder_forward(weights, batch, kv_cache, cfg, ops, dense_mlp, aux_layers)
