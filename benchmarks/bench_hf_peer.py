"""The peer in the same run: HF transformers (PyTorch) generating at the same shape and lengths.

Runs where torch + transformers are installed (the H100 machine); never imported by jinfer.
    python3 -m benchmarks.bench_hf_peer --shape qwen3-4b --input-len 1024 --output-len 128 --batch-sizes 1 32
Random weights at the named shape (bf16, SDPA attention), greedy, no EOS stop. TTFT = one forward
over the prompt batch; TPOT = (generate time - TTFT) / (output_len - 1).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import write_result

SHAPES = {  # the HF configs of jinfer's NAMED_SHAPES
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                     rope_theta=1e6, max_position_embeddings=40960),
}


def main():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(SHAPES))
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3Config(**SHAPES[args.shape], attn_implementation="sdpa")
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).eval()
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
