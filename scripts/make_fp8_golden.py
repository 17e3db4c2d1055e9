#!/usr/bin/env python
"""Block-FP8 versions of the tiny checkpoints and their goldens, from HF transformers on the dequantized weights.

Run with the PyTorch environment (as scripts/make_golden.py), after it:

    /tmp/torchenv/bin/python scripts/make_fp8_golden.py

For each of tiny-qwen3, tiny-qwen3_moe, tiny-qwen3_5 and tiny-deepseek_v3 this quantizes the linear weights of the
committed float32 checkpoint to the block-FP8 format the published FP8 checkpoints use (`weight` in float8_e4m3fn,
`weight_scale_inv` one scale per [16, 16] block of the [out, in] weight: the tiny shapes are too small for 128, and
the format allows any block size), writes tests/data/tiny-<arch>-fp8/ with its `quantization_config`, then builds the
HF model from the DEQUANTIZED weights (value * scale, float32) and records its logits and greedy ids on the tiny
goldens' prompts in tests/data/golden/tiny-<arch>-fp8.npz. jinfer reading the FP8 files must match these to float32
noise.

The quantization is written here in torch, independently of jinfer's (jinfer/models/fp8.py): per block,
scale = amax / 448 and value = float8_e4m3fn(w / scale) (round to nearest even, as vLLM and DeepSeek quantize).
What stays unquantized, as in the published checkpoints: embeddings, norms, lm_head, MoE routers (`mlp.gate`); in
tiny-qwen3_5 also the linear layers' in_proj_a / in_proj_b (listed in modules_to_not_convert); in tiny-qwen3 layer 1's
o_proj is stored unquantized without being listed (jinfer must keep what the checkpoint stores). tiny-deepseek_v3 as
DeepSeek-V3's own FP8 release: every projection (MLA's q_a / q_b / kv_a / kv_b too, their 24- and 40-row shapes
partial blocks), float32 scales, no modules_to_not_convert.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import (  # noqa: E402
    DATA,
    GOLDEN,
    META,
    MIN_MARGIN_BY_ARCH,
    MIN_ROUTER_GAP,
    MIN_ROUTER_GAP_BY_ARCH,
    N_DECODE,
    VOCAB,
    greedy_with_cache,
    router_gap,
    top2_margin,
)

BLOCK = (16, 16)  # [out, in] per scale
FP8_MAX = 448.0
MIN_MARGIN = 1e-3  # jinfer vs HF on the same dequantized weights differ by ~1e-6
# arch -> (modules_to_not_convert written to the config, tensors left unquantized, scales' dtype)
CASES = {
    "qwen3": (["lm_head"], {"model.layers.1.self_attn.o_proj.weight"}, torch.float32),
    "qwen3_moe": (["lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"], set(), torch.bfloat16),
    "qwen3_5": (["lm_head"] + [f"model.layers.{i}.linear_attn.in_proj_{p}" for i in (0, 2) for p in "ab"], set(),
                torch.float32),
    "deepseek_v3": ([], set(), torch.float32),
}


def quantize(w: torch.Tensor, block=BLOCK, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float -> (float8_e4m3fn values, scales [ceil(out / bo), ceil(in / bi)])."""
    out, inp = w.shape
    bo, bi = block
    po, pi = -(-out // bo) * bo, -(-inp // bi) * bi
    padded = torch.zeros(po, pi, dtype=torch.float32)
    padded[:out, :inp] = w.float()
    blocks = padded.reshape(po // bo, bo, pi // bi, bi)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    q = (blocks / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(po, pi)[:out, :inp].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    s = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]
    return q.float() * s


def converts(name: str, skip: list[str]) -> bool:
    module = name.removesuffix(".weight")
    linear = name.endswith(".weight") and "proj" in module.rsplit(".", 1)[-1]  # q_proj, in_proj_qkv, out_proj...
    return linear and not any(module == s or module.endswith("." + s) for s in skip)


@torch.no_grad()
def make(arch: str) -> None:
    skip, unlisted, scale_dtype = CASES[arch]
    src, dst = DATA / f"tiny-{arch}", DATA / f"tiny-{arch}-fp8"
    tensors = load_file(src / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if t.ndim == 2 and converts(name, skip) and name not in unlisted:
            q, s = quantize(t, scale_dtype=scale_dtype)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize(q, s)
        else:
            quantized[name] = dequantized[name] = t
    config = json.loads((src / "config.json").read_text())
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir()
    save_file(quantized, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic",
        "modules_to_not_convert": skip}}, indent=2) + "\n")
    for extra in ("generation_config.json",):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)

    model = hf_model(dequantized, src)
    margins = write_goldens(model, arch, f"tiny-{arch}-fp8", {"fp8_block": BLOCK})
    n = sum(k.endswith("_scale_inv") for k in quantized)
    size = (dst / "model.safetensors").stat().st_size
    print(f"tiny-{arch}-fp8: {n} FP8 weights, {size / 1024:.0f} KB, min top2 margins {[f'{m:.4f}' for m in margins]}")


def hf_model(dequantized: dict[str, torch.Tensor], src: Path):
    """HF transformers' model (float32, eager attention) on the dequantized weights, with src's config."""
    with tempfile.TemporaryDirectory() as tmp:  # HF reads the dequantized weights as a plain float32 checkpoint
        save_file({k: v.float() for k, v in dequantized.items()}, Path(tmp) / "model.safetensors",
                  metadata={"format": "pt"})
        shutil.copy(src / "config.json", Path(tmp) / "config.json")
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def write_goldens(model, arch: str, name: str, meta: dict, decoded=(0, 1, 2)) -> list[float]:
    """tests/data/golden/<name>.npz: the model's prefill logits, greedy ids and (for the prompts in `decoded`) decode
    logits on the float goldens' prompts of tiny-<arch>, another prompt where a greedy step's top-2 margin is under
    MIN_MARGIN or a MoE layer's router gap under MIN_ROUTER_GAP. Returns each prompt's smallest margin."""
    base = np.load(GOLDEN / f"tiny-{arch}.npz")
    rng = np.random.default_rng(11)
    min_margin = max(MIN_MARGIN, MIN_MARGIN_BY_ARCH.get(arch, 0.0))  # (DeepSeek's grouped routing: the float goldens')
    min_gap = MIN_ROUTER_GAP_BY_ARCH.get(arch, MIN_ROUTER_GAP)
    arrays, margins = {}, []
    for i in range(3):
        prompt = base[f"prompt_{i}"]
        for _attempt in range(200):  # the float goldens' prompt first, another where FP8 made a step too close
            prefill, greedy, dec = greedy_with_cache(model, prompt.tolist(), N_DECODE)
            if top2_margin(dec).min() >= min_margin and router_gap(
                    model, prompt.tolist() + greedy.tolist()) >= min_gap:
                break
            prompt = rng.integers(0, VOCAB, size=len(prompt)).astype(np.int32)
        else:
            raise RuntimeError(f"no prompt with margin >= {min_margin} and router gap >= {min_gap} for {name} "
                               f"prompt {i}")
        arrays |= {f"prompt_{i}": prompt, f"prefill_logits_{i}": prefill.astype(np.float32), f"greedy_{i}": greedy}
        if i in decoded:
            arrays[f"decode_logits_{i}"] = dec.astype(np.float32)
        margins.append(float(top2_margin(dec).min()))
    arrays["meta"] = np.array(json.dumps({**META, "arch": arch, **meta, "n_decode": N_DECODE, "min_margin": min_margin,
                                          "source": f"tiny-{arch} quantized"}))
    np.savez(GOLDEN / f"{name}.npz", **arrays)
    return margins


def main() -> None:
    for arch in sys.argv[1:] or CASES:
        make(arch)


if __name__ == "__main__":
    main()
