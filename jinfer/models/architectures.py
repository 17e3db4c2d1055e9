"""The architectures jinfer runs, as data: their names in HF configs and GGUF files and the switches
their config and checkpoints need. JAX-free, so that jinfer/config/model.py reads it; the registry
(jinfer/models/registry.py) adds each architecture's model functions.

A new architecture is one entry here, one in the registry's table and, for a new family, its module.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One architecture. `name` is ours (`ModelConfig.architecture`); `hf_names` are the HF
    `architectures[0]` values that load as it, of which `hf_multimodal_names` keep the text model's config
    under `text_config` (and its weights under `model.language_model.`); `gguf_name` is GGUF's
    `general.architecture` (None: no GGUF support). `hf_pooling_names`, also among `hf_names`, are base models without
    an LM head (`Qwen3Model`): they load as embedding models (`ModelConfig.pooling`), their tensors without the
    `model.` prefix."""

    name: str
    hf_names: tuple[str, ...]
    gguf_name: str | None = None
    hf_multimodal_names: tuple[str, ...] = ()
    hf_pooling_names: tuple[str, ...] = ()
    attention_bias: bool = False  # bias on the q/k/v projections (qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (qwen3)
    mixture_of_experts: bool = False  # the config carries experts (num_experts, top-k, ...)
    linear_attention: bool = False  # Gated DeltaNet layers beside full attention (the config's layer_types)
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted the rows of Q and K (to interleave RoPE)
    latent_attention: bool = False  # multi-head latent attention (DeepSeek's MLA): a latent KV row per token

    def __post_init__(self):
        if not self.name.isidentifier():
            raise ValueError(f"name={self.name!r} must be an identifier")
        if not self.hf_names:
            raise ValueError(f"hf_names={self.hf_names!r} must name at least one HF architecture ({self.name})")
        if not set(self.hf_multimodal_names) <= set(self.hf_names):
            raise ValueError(f"hf_multimodal_names={self.hf_multimodal_names!r} must be among "
                             f"hf_names={self.hf_names!r}")
        if not set(self.hf_pooling_names) <= set(self.hf_names):
            raise ValueError(f"hf_pooling_names={self.hf_pooling_names!r} must be among hf_names={self.hf_names!r}")


# llama / qwen2 / qwen3: the llama-style dense decoder (jinfer/models/llama.py) with a few switches;
# qwen3_moe: Qwen3 attention with mixture-of-experts MLPs; qwen3_5: Gated DeltaNet and gated attention (qwen3_5_moe:
# with routed experts and a shared one in every layer, jinfer/models/qwen3_5.py);
# deepseek_v2 / deepseek_v3 (also Kimi-K2, Moonlight): latent attention and DeepSeekMoE (jinfer/models/deepseek.py).
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("LlamaForCausalLM", "LlamaModel"), "llama", hf_pooling_names=("LlamaModel",),
                 gguf_permuted_qk=True),
    Architecture("qwen2", ("Qwen2ForCausalLM", "Qwen2Model"), "qwen2", hf_pooling_names=("Qwen2Model",),
                 attention_bias=True),
    Architecture("qwen3", ("Qwen3ForCausalLM", "Qwen3Model"), "qwen3", hf_pooling_names=("Qwen3Model",), qk_norm=True),
    # llama.cpp spells qwen3_moe without the underscore
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3moe", qk_norm=True, mixture_of_experts=True),
    # the published checkpoints are the multimodal ones; only their text part is loaded
    Architecture("qwen3_5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), None,
                 hf_multimodal_names=("Qwen3_5ForConditionalGeneration",), qk_norm=True, linear_attention=True),
    Architecture("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), None,
                 hf_multimodal_names=("Qwen3_5MoeForConditionalGeneration",), qk_norm=True, mixture_of_experts=True,
                 linear_attention=True),
    # GGUF's one `deepseek2` serves both: a sigmoid-gated file loads as deepseek_v3 (jinfer/config/deepseek_gguf.py)
    Architecture("deepseek_v2", ("DeepseekV2ForCausalLM",), "deepseek2", mixture_of_experts=True,
                 latent_attention=True),
    Architecture("deepseek_v3", ("DeepseekV3ForCausalLM",), None, mixture_of_experts=True, latent_attention=True),
)}

# HF `architectures[0]` -> our name; GGUF `general.architecture` -> our name
HF_ARCHITECTURES: dict[str, str] = {hf: a.name for a in ARCHITECTURES.values() for hf in a.hf_names}
GGUF_ARCHITECTURES: dict[str, str] = {a.gguf_name: a.name for a in ARCHITECTURES.values() if a.gguf_name}
