#!/usr/bin/env python
"""FP8 checkpoints in vLLM's compressed-tensors format from the tiny float32 checkpoints, and their goldens from HF
transformers on the dequantized weights.

Run with the PyTorch environment (as scripts/make_golden.py), after it:

    /tmp/torchenv/bin/python scripts/make_compressed_tensors_golden.py

The checkpoints are written as llm-compressor writes them (`quant_method: compressed-tensors`, format
`float-quantized`; a linear layer's `weight` [out, in] in float8_e4m3fn beside `weight_scale`, value = weight *
weight_scale), the quantization written here in torch, independently of jinfer's: scale = amax / 448 over the
tensor or over each output row, value = float8_e4m3fn(w / scale) (round to nearest even). Unquantized tensors are
stored in bfloat16, as the published checkpoints keep them.

- tiny-qwen3-ct-tensor/: tiny-qwen3 in llm-compressor's FP8 scheme: one float32 scale [1] per weight and a static
  per-tensor activation scale (`input_scale` [1], which jinfer does not read); `ignore`: lm_head and, by its exact
  name, layer 1's o_proj (stored bfloat16).
- tiny-qwen3_moe-ct-mixed/: tiny-qwen3_moe in two config groups: attention (`re:.*self_attn.*`) per tensor, the MLPs
  (the experts and layer 1's dense MLP, `re:.*mlp.*`) per output channel, scales [out, 1] in bfloat16 (FP8_DYNAMIC:
  activations dynamic per token); `ignore`: lm_head and the routers as a regular expression (`re:.*mlp.gate$`).

Goldens (tests/data/golden/<name>.npz): make_fp8_golden's, the float goldens' prompts unless FP8 made a greedy step's
top-2 margin < 1e-3 (or a router gap < 1e-3); decode logits for prompt 0 only (the tests' decode steps run it).
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fp8_golden import DATA, FP8_MAX, converts, hf_model, write_goldens  # noqa: E402

FLOAT8 = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "actorder": None,
          "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
STATIC_TENSOR = FLOAT8 | {"strategy": "tensor", "dynamic": False}
DYNAMIC_TOKEN = FLOAT8 | {"strategy": "token", "dynamic": True, "observer": None}
# name -> (source arch, config groups: (targets regex or "Linear", weight strategy, input activations, scale dtype),
#          ignore list)
CASES = {
    "tiny-qwen3-ct-tensor": ("qwen3", [("Linear", "tensor", STATIC_TENSOR, torch.float32)],
                             ["lm_head", "model.layers.1.self_attn.o_proj"]),
    "tiny-qwen3_moe-ct-mixed": ("qwen3_moe", [("re:.*self_attn.*", "tensor", DYNAMIC_TOKEN, torch.float32),
                                              ("re:.*mlp.*", "channel", DYNAMIC_TOKEN, torch.bfloat16)],
                                ["lm_head", "re:.*mlp.gate$"]),
}


def quantize(w: torch.Tensor, strategy: str, scale_dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn values, scales [1] (tensor) or [out, 1] (channel)) in scale_dtype; the values
    divided by the stored (rounded) scale, as llm-compressor quantizes."""
    w = w.float()
    amax = w.abs().amax().reshape(1) if strategy == "tensor" else w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    return (w / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def ignored(module: str, ignore: list[str]) -> bool:
    return any(re.match(s[3:], module) if s.startswith("re:") else module == s for s in ignore)


def group_of(module: str, groups) -> tuple | None:
    return next((g for g in groups if g[0] == "Linear" or re.match(g[0][3:], module)), None)


@torch.no_grad()
def make(name: str) -> None:
    arch, groups, ignore = CASES[name]
    src, dst = DATA / f"tiny-{arch}", DATA / name
    stored, dequantized = {}, {}
    for key, t in load_file(src / "model.safetensors").items():
        module = key.removesuffix(".weight")
        group = group_of(module, groups)
        if t.ndim == 2 and converts(key, []) and not ignored(module, ignore) and group is not None:
            _, strategy, acts, scale_dtype = group
            q, s = quantize(t, strategy, scale_dtype)
            stored[key], stored[module + ".weight_scale"] = q, s
            if not acts["dynamic"]:  # a calibrated activation scale in the real scheme; any positive value here
                stored[module + ".input_scale"] = torch.tensor([0.02], dtype=torch.float32)
            dequantized[key] = q.float() * s.float()
        else:
            stored[key] = t.to(torch.bfloat16)
            dequantized[key] = stored[key].float()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "config_groups": {f"group_{i}": {"targets": [target], "weights": FLOAT8 | {"strategy": strategy,
                                                                                     "dynamic": False},
                                         "input_activations": acts, "output_activations": None, "format": None}
                          for i, (target, strategy, acts, _) in enumerate(groups)},
        "format": "float-quantized", "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
        "transform_config": {}, "version": "0.12.2"}
    config["dtype"] = "bfloat16"
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")

    margins = write_goldens(hf_model(dequantized, src), arch, name,
                            {"compressed_tensors": [g[:2] for g in groups]}, decoded=(0,))
    n = sum(k.endswith("weight_scale") for k in stored)
    size = (dst / "model.safetensors").stat().st_size
    print(f"{name}: {n} FP8 weights, {size / 1024:.0f} KB, min top2 margins {[f'{m:.4f}' for m in margins]}")


def main() -> None:
    for name in sys.argv[1:] or CASES:
        make(name)


if __name__ == "__main__":
    main()
