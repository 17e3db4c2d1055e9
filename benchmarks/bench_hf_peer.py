"""The peer in the same run: HF transformers (PyTorch) generating at the same shape and lengths.

Runs where torch + transformers are installed (the H100 machine); never imported by jinfer.
    python3 -m benchmarks.bench_hf_peer --shape qwen3-4b --input-len 1024 --output-len 128 --batch-sizes 1 32
    python3 -m benchmarks.bench_hf_peer --shape qwen3-30b-a3b --batch-sizes 1 8    # Qwen3MoeForCausalLM
Random weights at one of jinfer's named shapes (`jinfer.config.NAMED_SHAPES`; the HF config is derived from
it: Qwen3 / Qwen3-MoE / Qwen3.5 text), built directly in bf16 on the GPU (SDPA attention), greedy, no EOS stop.
TTFT = one forward over the prompt batch; TPOT = (generate time - TTFT) / (output_len - 1).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import write_result
from jinfer.config import NAMED_SHAPES

HF_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
              "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM")}
SHAPES = sorted(name for name, cfg in NAMED_SHAPES.items() if cfg.architecture in HF_CLASSES)


def hf_config_kwargs(shape: str) -> dict:
    """The HF config (keyword arguments) of a named shape: the fields HF's Qwen3 families read."""
    c = NAMED_SHAPES[shape]
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
              head_dim=c.head_dim, tie_word_embeddings=c.tie_word_embeddings, rms_norm_eps=c.rms_norm_eps,
              max_position_embeddings=c.max_position_embeddings,
              rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta})
    if c.architecture == "qwen3_moe":
        kw |= dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                   decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers))
    if c.architecture == "qwen3_5":
        kw["rope_parameters"] |= {"partial_rotary_factor": c.partial_rotary_factor}
        kw |= dict(layer_types=list(c.layer_types), linear_num_key_heads=c.linear_num_key_heads,
                   linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
                   linear_value_head_dim=c.linear_value_head_dim, linear_conv_kernel_dim=c.linear_conv_kernel_dim)
    return kw


def main():
    import torch
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=SHAPES)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[NAMED_SHAPES[args.shape].architecture])
    cfg = config_cls(**hf_config_kwargs(args.shape), attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 30B model in fp32 would not fit
    with torch.device("cuda"):
        model = model_cls(cfg).eval()
    rows = []
    for bs in args.batch_sizes:
        ids = torch.randint(0, cfg.vocab_size, (bs, args.input_len), device="cuda")
        gen = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                   eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            model.generate(ids, **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(ids)
            torch.cuda.synchronize()
            ttft = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(ids, **gen)
            torch.cuda.synchronize()
            total = time.perf_counter() - t
        n_new = out.shape[1] - args.input_len
        tpot = (total - ttft) / max(n_new - 1, 1)
        rows.append({"batch_size": bs, "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "generate_s": total,
                     "output_tokens_per_s": bs * n_new / total,
                     "total_tokens_per_s": bs * (n_new + args.input_len) / total})
        print(f"HF batch {bs}: TTFT {ttft * 1e3:.1f} ms, TPOT {tpot * 1e3:.2f} ms, {bs * n_new / total:.0f} out tok/s")
    import os
    result = {"benchmark": "hf_peer", "device": torch.cuda.get_device_name(), "torch_version": torch.__version__,
              "commit": os.environ.get("JINFER_COMMIT", "unknown"), "shape": args.shape,
              "input_len": args.input_len, "output_len": args.output_len, "rows": rows}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
