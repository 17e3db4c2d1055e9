"""Weight quantization settings (JAX-free): the FP8 formats, read from a checkpoint's `quantization_config` or asked
for online (`--quantization fp8`).

Block FP8 is the format DeepSeek-V3, Qwen3-*-FP8 and Qwen3.5-*-FP8 ship and transformers' `FineGrainedFP8Config`
writes: a linear layer's `weight` [out, in] in float8_e4m3fn and `weight_scale_inv`
[ceil(out / block_n), ceil(in / block_k)] (float32 or bf16) multiplying each block back (despite the name, the
dequantized weight is `weight * weight_scale_inv`). Activations stay in the model's dtype: "dynamic" activation
scaling only matters to FP8 tensor-core matmuls, which quantize activations per token-group at run time; a weight-only
compute path reads the same weights. Norms, embeddings, the lm_head, routers and `modules_to_not_convert` stay
unquantized.

FP8 checkpoints in vLLM's `compressed-tensors` format (llm-compressor's FP8, FP8_DYNAMIC, FP8_BLOCK schemes:
`quant_method: compressed-tensors`, format `float-quantized` or `naive-quantized`) land on the same path: a weight
[out, in] in float8_e4m3fn beside `weight_scale`, which multiplies too, one scale per tensor ([1] or []), per output
channel ([out, 1]) or per `block_structure` block. Each is read as block scales, exactly (`compressed_tensors_config`
picks the blocks, jinfer/weights/safetensors.py's `block_scales` fills them): a block checkpoint keeps its blocks; a
per-tensor one gets 128 x 128 blocks holding its one scale; a per-channel one (or one mixing tensor and channel groups)
blocks of 1 row x 128 columns of [out, in], each holding its row's scale. A row is an output column of jinfer's
[in, out] weight, so the kernels load a scale per column of a tile instead of one per tile, and the scales take 4
bytes per 128 weight bytes. The alternatives were worse: requantizing to 128 x 128 blocks rounds every weight a
second time, dequantizing to bf16 doubles its bytes. Activation quantization (dynamic per token / group, or a static
`input_scale`) is not applied, as for block-FP8: activations stay in the model's dtype, as in vLLM's weight-only FP8
path; `input_scale` tensors are not read. `ignore` maps to `modules_to_not_convert` (its `re:` entries are regular
expressions, matched from the module name's start). Which weights a group targets is not read: a weight is FP8 where
the checkpoint stores it with a `weight_scale`, as with block-FP8.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_BLOCK", "Fp8Config", "compressed_tensors_config", "quantization_from_hf"]

DEFAULT_BLOCK = (128, 128)  # (block_n: out, block_k: in): every published block-FP8 checkpoint's, transformers' default
SCALE_SUFFIXES = ("_scale_inv", "_scale")  # `<name>.weight` + this: block-FP8's, compressed-tensors'
CT_FORMATS = ("float-quantized", "naive-quantized")  # both store FP8 weights as float8_e4m3fn


@dataclass(frozen=True)
class Fp8Config:
    """Block-FP8 weights. `block` is (out, in) rows and columns of the checkpoint's [out, in] weight per scale, as
    `weight_block_size` writes it. `online`: the checkpoint holds float weights that the loader quantizes (a weight
    stored in FP8 is read as it is); otherwise a weight the checkpoint keeps unquantized stays so. `scale_suffix`:
    where the checkpoint keeps a weight's scales, `<name>.weight` + it (a compressed-tensors checkpoint's per-tensor
    or per-channel scales are spread over `block` as they are read)."""

    block: tuple[int, int] = DEFAULT_BLOCK
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False
    scale_suffix: str = "_scale_inv"

    def __post_init__(self):
        if (not isinstance(self.block, tuple) or len(self.block) != 2
                or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in self.block)):
            raise ValueError(f"weight_block_size={self.block!r} must be two positive integers [out, in]")
        if not all(isinstance(m, str) and m for m in self.modules_to_not_convert):
            raise ValueError(f"modules_to_not_convert={self.modules_to_not_convert!r} must be module names")
        if self.scale_suffix not in SCALE_SUFFIXES:
            raise ValueError(f"scale_suffix={self.scale_suffix!r} must be one of {SCALE_SUFFIXES}")

    def converts(self, module: str) -> bool:
        """Whether the checkpoint quantizes `module` ("model.layers.0.mlp.gate"): not when a name of
        `modules_to_not_convert` is it, a dotted prefix of it or a dotted part of it (the lists name whole modules,
        some with the multimodal `model.language_model.` prefix, some bare: "lm_head", "mlp.gate"). A name
        "re:<pattern>" (compressed-tensors' `ignore`) is a regular expression matched from the name's start."""
        names = {module, module.replace("model.", "model.language_model.", 1)}
        for skip in self.modules_to_not_convert:
            for name in names:
                if skip.startswith("re:"):
                    if re.match(skip[3:], name):
                        return False
                elif name == skip or name.startswith(skip + ".") or f".{skip}." in f".{name}.":
                    return False
        return True


def quantization_from_hf(qc: Any) -> Fp8Config | None:
    """A config.json's `quantization_config` -> Fp8Config; None without one. ValueError naming the field for a format
    jinfer does not read (GPTQ, AWQ, integer compressed-tensors, ...) or a bad value."""
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config field 'quantization_config'={qc!r} must be an object")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return compressed_tensors_config(qc)
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported: jinfer reads block-FP8 "
                         "checkpoints ('fp8'), FP8 'compressed-tensors' ones and unquantized ones")
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


def compressed_tensors_config(qc: dict) -> Fp8Config:
    """A `quant_method: compressed-tensors` config -> Fp8Config (see the module's docstring): every config group's
    weights 8-bit float, symmetric, static, per tensor, channel or block (one `block_structure` for all). ValueError
    naming the field for anything else: integer or 4-bit weights, another `format`, sparsity, transforms, quantized
    outputs."""
    fmt = qc.get("format")
    for field in ("sparsity_config", "transform_config"):
        if qc.get(field):
            raise ValueError(f"quantization_config.{field} is not supported: jinfer reads dense FP8 compressed-tensors "
                             "checkpoints")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"quantization_config.config_groups={groups!r} must be an object of quantization groups")
    strategies = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ValueError(f"{where}={group!r} must be an object")
        gfmt = group.get("format") or fmt
        if gfmt not in CT_FORMATS:
            field = f"{where}.format" if group.get("format") else "quantization_config.format"
            raise ValueError(f"{field}={gfmt!r} is not supported: only {CT_FORMATS} (FP8 weights)")
        targets = group.get("targets")
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"{where}.targets={targets!r} must be a list of module names or types")
        strategies.add(_fp8_weights(f"{where}.weights", group.get("weights")))
        acts = group.get("input_activations")
        if acts is not None and not (isinstance(acts, dict) and acts.get("type") == "float"
                                     and acts.get("num_bits") == 8):
            raise ValueError(f"{where}.input_activations={acts!r} is not supported: only none or 8-bit float "
                             "(activations stay in the model's dtype)")
        if group.get("output_activations") is not None:
            raise ValueError(f"{where}.output_activations={group['output_activations']!r} is not supported: only null")
    blocks = {s for s in strategies if isinstance(s, tuple)}
    if blocks and len(strategies) > 1:
        raise ValueError(f"quantization_config.config_groups mix weight strategies {sorted(map(str, strategies))}: "
                         "jinfer reads one block_structure, or per-tensor and per-channel groups together")
    block = blocks.pop() if blocks else DEFAULT_BLOCK if strategies == {"tensor"} else (1, DEFAULT_BLOCK[1])
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list | tuple):
        raise ValueError(f"quantization_config.ignore={ignore!r} must be a list of module names")
    return Fp8Config(block, tuple(ignore), scale_suffix="_scale")


def _fp8_weights(where: str, w: Any) -> str | tuple[int, int]:
    """A group's `weights` args -> "tensor" | "channel" | its block_structure (out, in); ValueError for the rest."""
    if not isinstance(w, dict):
        raise ValueError(f"{where}={w!r} is not supported: a group must quantize its weights")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"{where}: type={w.get('type')!r}, num_bits={w.get('num_bits')!r} is not supported: only "
                         "8-bit float (FP8 e4m3) weights")
    if w.get("symmetric", True) is not True or w.get("dynamic", False) is not False:
        raise ValueError(f"{where}: symmetric={w.get('symmetric')!r}, dynamic={w.get('dynamic')!r} is not supported: "
                         "only symmetric static weight scales")
    strategy = w.get("strategy")
    if strategy in ("tensor", "channel"):
        return strategy
    if strategy != "block":
        raise ValueError(f"{where}.strategy={strategy!r} is not supported: only 'tensor', 'channel' or 'block'")
    block = w.get("block_structure")
    if not isinstance(block, list | tuple) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise ValueError(f"{where}.block_structure={block!r} must be [out, in]")
    return tuple(block)
