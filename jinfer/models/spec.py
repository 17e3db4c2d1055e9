"""`ArrayInfo`: the one description of a weight, from which random init, sharding and checkpoint
loading are derived (jax-llm-examples' `ArrayInfo`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jinfer.config.quantization import Fp8Config

EXPERT = "{expert}"  # placeholder in `hf_name` of a stacked per-expert weight


@dataclass(frozen=True)
class ArrayInfo:
    """One weight: its shape and logical axes in jinfer's layout, and where checkpoints keep it.

    Linear weights are stored [in, out] here (x @ W); checkpoints keep them [out, in], hence
    `transpose` (of the last two axes). `init` is the dummy-weight initializer: "normal" (std 0.02),
    "ones" or "zeros". `dtype`, where given, overrides the model's (HF keeps DeepSeek-V3's routing bias in float32).

    Mixture-of-experts weights are stacked per layer, [num_experts, ...]. Published HF checkpoints keep
    one tensor per expert: `hf_name` then holds `EXPERT` ("...experts.{expert}.gate_proj.weight") and
    the loader stacks experts 0..E-1. transformers' in-memory layout (what some tools save) is one
    tensor for all experts with gate and up concatenated on the output axis: `hf_fused` = (its name,
    which part this weight is, how many parts), read when the per-expert tensors are absent. GGUF keeps
    experts stacked already (`blk.N.ffn_gate_exps.weight`).
    """

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    hf_name: str
    gguf_name: str
    transpose: bool = False
    init: str = "normal"
    hf_fused: tuple[str, int, int] | None = None
    dtype: str | None = None  # None: the model's dtype; e.g. "float32" for a weight kept in it (a routing bias)
    # Block FP8 (`quantize_specs`): (in, out) rows and columns per float32 scale in jinfer's [in, out] layout; the
    # weight is then a `jinfer.models.fp8.Fp8Weight` (float8_e4m3fn values + a scale per block). None: unquantized.
    fp8_block: tuple[int, int] | None = None

    def scale_shape(self) -> tuple[int, ...]:
        """An FP8 weight's scales: one per block of its last two axes (a partial block at the end counts)."""
        bk, bn = self.fp8_block
        *lead, k, n = self.shape
        return (*lead, -(-k // bk), -(-n // bn))

    def checkpoint_shape(self) -> tuple[int, ...]:
        """The shape a checkpoint stores (the last two axes swapped when `transpose`)."""
        if not self.transpose:
            return self.shape
        return (*self.shape[:-2], self.shape[-1], self.shape[-2])


@dataclass(frozen=True)
class StateSpec:
    """One array of a layer's fixed-size per-sequence state (linear-attention layers): the cache holds a
    pool `[num_state_slots, *shape]` of it, one slot per running sequence. `dtype` None: the KV cache's."""

    shape: tuple[int, ...]
    dtype: str | None = None
    axes: tuple[str | None, ...] | None = None  # logical axes of `shape` (jinfer/parallel/mesh.py); None: replicated


ROUTERS = ("router",)  # kept unquantized whatever the checkpoint: HF (and vLLM) never quantize a MoE gate


def quantize_specs(specs: dict[str, ArrayInfo], quant: Fp8Config | None) -> dict[str, ArrayInfo]:
    """The specs with every linear weight (stored [out, in] in checkpoints: `transpose`) marked block-FP8, unless it is
    the lm_head, a router or one of the checkpoint's `modules_to_not_convert`. A family states nothing for this."""
    if quant is None:
        return specs
    out = {}
    for name, spec in specs.items():
        local = name.rsplit(".", 1)[-1]
        module = spec.hf_name.removesuffix(".weight")
        if spec.transpose and len(spec.shape) >= 2 and name != "lm_head" and local not in ROUTERS \
                and quant.converts(module):
            spec = dataclasses.replace(spec, fp8_block=(quant.block[1], quant.block[0]))  # HF's (out, in) -> (in, out)
        out[name] = spec
    return out
