"""The peer in the same run: HF transformers (PyTorch) generating at the same shape and lengths.

Runs where torch + transformers are installed (the H100 machine); never imported by jinfer.
    python3 -m benchmarks.bench_hf_peer --shape qwen3-4b --input-len 1024 --output-len 128 --batch-sizes 1 32
    python3 -m benchmarks.bench_hf_peer --shape qwen3-30b-a3b --batch-sizes 1 8    # Qwen3MoeForCausalLM
Random weights at one of jinfer's named shapes (`jinfer.config.NAMED_SHAPES`; the HF config is derived from
it: Qwen3 / Qwen3-MoE / Qwen3.5 text), built directly in bf16 on the GPU (SDPA attention), greedy, no EOS stop.
TTFT = one forward over the prompt batch; TPOT = (generate time - TTFT) / (output_len - 1).

`--static-compile` (#17's peer: gpt-fast style): a StaticCache, the prompt's forward eager, then a loop of decode
steps through `torch.compile(mode="reduce-overhead", fullgraph=True)` (CUDA graphs), greedy on the device, one
sync at the end; TPOT = the loop's time / (output_len - 1), after a warm-up pass that compiles and records.
    python3 -m benchmarks.bench_hf_peer --shape qwen3-4b --batch-sizes 1 8 32 --static-compile
(`--device cpu --num-layers 2 --compile-mode default`: a smoke test of the script without a GPU.)
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import write_result
from jinfer.config.model import NAMED_SHAPES

HF_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
              "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
              "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM")}
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
    if c.architecture == "qwen3_5_moe":  # (every layer sparse; the config has no norm_topk_prob: always on)
        kw |= dict(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.shared_expert_intermediate_size)
    if c.architecture in ("qwen3_5", "qwen3_5_moe"):
        kw["rope_parameters"] |= {"partial_rotary_factor": c.partial_rotary_factor}
        kw |= dict(layer_types=list(c.layer_types), linear_num_key_heads=c.linear_num_key_heads,
                   linear_num_value_heads=c.linear_num_value_heads, linear_key_head_dim=c.linear_key_head_dim,
                   linear_value_head_dim=c.linear_value_head_dim, linear_conv_kernel_dim=c.linear_conv_kernel_dim)
    return kw


def static_compiled_generate(torch, model, cfg, ids, output_len: int, mode: str, fullgraph: bool) -> dict:
    """Greedy generation gpt-fast style (see the module doc); returns TTFT, TPOT and the tokens."""
    from transformers import StaticCache

    device = ids.device
    L = ids.shape[1]
    cache = StaticCache(config=cfg, max_cache_len=L + output_len)

    def decode_step(tok, pos):
        logits = model(tok, past_key_values=cache, cache_position=pos, use_cache=True).logits
        return logits[:, -1].argmax(-1, keepdim=True)

    step = torch.compile(decode_step, mode=mode, fullgraph=fullgraph)

    def run(n_steps: int):
        cache.reset()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        logits = model(ids, past_key_values=cache, cache_position=torch.arange(L, device=device), use_cache=True).logits
        tok = logits[:, -1].argmax(-1, keepdim=True)
        sync()
        t1 = time.perf_counter()
        pos = torch.tensor([L], device=device)
        toks = [tok]
        for _ in range(n_steps):
            tok = step(tok, pos).clone()  # (clone: a CUDA graph's output is overwritten by its next replay)
            pos += 1
            toks.append(tok)
        sync()
        return t1 - t0, time.perf_counter() - t1, torch.cat(toks, dim=1)

    with torch.inference_mode():
        run(min(4, output_len - 1))  # compile, record the graph
        ttft, decode_s, out = run(output_len - 1)
    return {"ttft_ms": ttft * 1e3, "tpot_ms": decode_s / max(output_len - 1, 1) * 1e3, "tokens": out}


def main():
    import torch
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=SHAPES)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--static-compile", action="store_true",
                    help="the gpt-fast style peer: StaticCache + torch.compile(mode=--compile-mode) decode loop")
    ap.add_argument("--compile-mode", default="reduce-overhead",
                    help="torch.compile mode (reduce-overhead: CUDA graphs)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-layers", type=int, default=None, help="fewer layers than the shape (smoke tests)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(0)
    config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[NAMED_SHAPES[args.shape].architecture])
    kw = hf_config_kwargs(args.shape) | ({"num_hidden_layers": args.num_layers} if args.num_layers else {})
    if args.num_layers and "layer_types" in kw:
        kw["layer_types"] = kw["layer_types"][:args.num_layers]
    cfg = config_cls(**kw, attn_implementation="sdpa")
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: a 30B model in fp32 would not fit
    with torch.device(args.device):
        model = model_cls(cfg).eval()
    rows = []
    for bs in args.batch_sizes:
        ids = torch.randint(0, cfg.vocab_size, (bs, args.input_len), device=args.device)
        if args.static_compile:
            try:
                r = static_compiled_generate(torch, model, cfg, ids, args.output_len, args.compile_mode, True)
                fullgraph = True
            except Exception as e:  # a graph break: report it and measure the broken graph (slower)
                print(f"fullgraph compile failed ({type(e).__name__}: {str(e)[:200]}); without fullgraph")
                torch._dynamo.reset()
                r = static_compiled_generate(torch, model, cfg, ids, args.output_len, args.compile_mode, False)
                fullgraph = False
            n_new = r["tokens"].shape[1]
            rows.append({"batch_size": bs, "ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"], "fullgraph": fullgraph,
                         "output_tokens": n_new})
            print(f"HF static+compile batch {bs}: TTFT {r['ttft_ms']:.1f} ms, TPOT {r['tpot_ms']:.2f} ms")
            torch._dynamo.reset()
            continue
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
    result = {"benchmark": "hf_peer_static_compile" if args.static_compile else "hf_peer",
              "compile_mode": args.compile_mode if args.static_compile else None,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "torch_version": torch.__version__, "transformers_version": transformers.__version__,
              "commit": os.environ.get("JINFER_COMMIT", "unknown"), "shape": args.shape,
              "input_len": args.input_len, "output_len": args.output_len, "rows": rows}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
