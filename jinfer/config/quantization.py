"""Weight quantization settings (JAX-free): the block-FP8 format, read from a checkpoint's `quantization_config` or
asked for online (`--quantization fp8`).

The format is the one DeepSeek-V3, Qwen3-*-FP8 and Qwen3.5-*-FP8 ship and transformers' `FineGrainedFP8Config`
writes: a linear layer's `weight` [out, in] in float8_e4m3fn and `weight_scale_inv`
[ceil(out / block_n), ceil(in / block_k)] (float32 or bf16) multiplying each block back (despite the name, the
dequantized weight is `weight * weight_scale_inv`). Activations stay in the model's dtype: "dynamic" activation
scaling only matters to FP8 tensor-core matmuls, which quantize activations per token-group at run time; a weight-only
compute path reads the same weights. Norms, embeddings, the lm_head, routers and `modules_to_not_convert` stay
unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_BLOCK", "Fp8Config", "quantization_from_hf"]

DEFAULT_BLOCK = (128, 128)  # (block_n: out, block_k: in): every published block-FP8 checkpoint's, transformers' default


@dataclass(frozen=True)
class Fp8Config:
    """Block-FP8 weights. `block` is (out, in) rows and columns of the checkpoint's [out, in] weight per scale, as
    `weight_block_size` writes it. `online`: the checkpoint holds float weights that the loader quantizes (a weight
    stored in FP8 is read as it is); otherwise a weight the checkpoint keeps unquantized stays so."""

    block: tuple[int, int] = DEFAULT_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False

    def __post_init__(self):
        if (not isinstance(self.block, tuple) or len(self.block) != 2
                or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in self.block)):
            raise ValueError(f"weight_block_size={self.block!r} must be two positive integers [out, in]")
        if not all(isinstance(m, str) and m for m in self.modules_to_not_convert):
            raise ValueError(f"modules_to_not_convert={self.modules_to_not_convert!r} must be module names")

    def converts(self, module: str) -> bool:
        """Whether the checkpoint quantizes `module` ("model.layers.0.mlp.gate"): not when a name of
        `modules_to_not_convert` is it, a dotted prefix of it or a dotted part of it (the lists name whole modules,
        some with the multimodal `model.language_model.` prefix, some bare: "lm_head", "mlp.gate")."""
        names = {module, module.replace("model.", "model.language_model.", 1)}
        for skip in self.modules_to_not_convert:
            for name in names:
                if name == skip or name.startswith(skip + ".") or f".{skip}." in f".{name}.":
                    return False
        return True


def quantization_from_hf(qc: Any) -> Fp8Config | None:
    """A config.json's `quantization_config` -> Fp8Config; None without one. ValueError naming the field for a format
    jinfer does not read (GPTQ, AWQ, compressed-tensors, ...) or a bad value."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config field 'quantization_config'={qc!r} must be an object")
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported: jinfer reads block-FP8 "
                         "checkpoints ('fp8') and unquantized ones")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported: only 'e4m3'")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported: only 'dynamic' "
                         "(static activation scales are not read)")
    block = qc.get("weight_block_size") or list(DEFAULT_BLOCK)
    if not isinstance(block, list | tuple) or len(block) != 2:
        raise ValueError(f"quantization_config.weight_block_size={block!r} must be [out, in]")
    skip = qc.get("modules_to_not_convert") or ()
    if not isinstance(skip, list | tuple):
        raise ValueError(f"quantization_config.modules_to_not_convert={skip!r} must be a list of module names")
    return Fp8Config(tuple(block), tuple(skip))
