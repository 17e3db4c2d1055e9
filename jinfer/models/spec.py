"""`ArrayInfo`: the one description of a weight, from which random init, sharding and checkpoint
loading are derived (jax-llm-examples' `ArrayInfo`)."""

from __future__ import annotations

from dataclasses import dataclass

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
