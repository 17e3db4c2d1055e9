"""Offline throughput through the `LLM` API: N prompts of L random tokens in, O tokens out.

    python -m benchmarks.bench_throughput --model dummy:qwen3-4b --num-prompts 256 --input-len 512 \
        --output-len 128 --out benchmarks/results/throughput_qwen3-4b.json

The timed run comes after an identical untimed one, so every shape it uses is already compiled
(the engine's warm-up is switched off to keep start-up short; `--warmup` turns it on instead).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.common import add_profile_argument, environment, profiled, write_result
from jinfer import LLM, SamplingParams
from jinfer.config.kernels import KernelPolicy


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:qwen3-4b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-pages", type=int)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 (e4m3 pages with scales: twice the pages)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="share of the device's memory for weights + KV pool (low: the KV pool limits the batch)")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--attention-backend", default="auto", help="auto | reference | pallas | pallas-triton")
    ap.add_argument("--warmup", action="store_true", help="compile all buckets at start-up instead of a dry run")
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--enable-expert-parallel", action="store_true")
    add_profile_argument(ap)
    ap.add_argument("--out")
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_pages=args.num_pages,
              max_model_len=args.input_len + args.output_len, warmup=args.warmup,
              async_scheduling=not args.no_async_scheduling, attention_backend=args.attention_backend,
              tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
              kernel_policy=KernelPolicy.from_env())
    startup_s = time.perf_counter() - t0
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()} for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def run(batch):
        t = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t, outs

    dry_s = None
    if not args.warmup:
        dry_s, _ = run(prompts)
    # Different prompts for the timed run, so no prefix-cache hits flatter it.
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()} for _ in range(args.num_prompts)]
    before = llm.engine.stats()
    with profiled(args.profile, python=not args.profile_no_python):
        elapsed, outs = run(prompts)
    after = llm.engine.stats()
    steps = after["steps_total"] - before["steps_total"]
    wait = after["device_wait_seconds_total"] - before["device_wait_seconds_total"]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    result = {
        "benchmark": "throughput", **environment(), "shape": args.model, "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype, "gpu_memory_utilization": args.gpu_memory_utilization,
        "tensor_parallel_size": args.tensor_parallel_size, "expert_parallel": args.enable_expert_parallel,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_pages": llm.engine.kv.num_usable_pages, "attention_backend": llm.engine.runner.ops.backend,
        "mosaic_prefill": llm.engine.runner.ops.mosaic_prefill,
        "async_scheduling": llm.engine.config.async_scheduling,
        "startup_s": startup_s, "dry_run_s": dry_s, "elapsed_s": elapsed,
        "requests_per_s": args.num_prompts / elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed, "output_tokens": n_out,
        # steps, and the share of the run the host spent outside the read-back wait: its own work plus launches
        # blocked on a full device queue, so near 1 is not proof of a host-bound run (--profile-no-python is)
        "steps": steps, "ms_per_step": 1e3 * elapsed / max(steps, 1), "device_wait_s": wait,
        "host_busy_fraction": 1 - wait / elapsed,
    }
    write_result(result, args.out)
    print(f"throughput: {result['requests_per_s']:.2f} req/s, {result['output_tokens_per_s']:.0f} output tok/s, "
          f"{result['total_tokens_per_s']:.0f} total tok/s, {steps} steps, {result['num_pages']} KV pages, "
          f"host busy {result['host_busy_fraction']:.0%}")


if __name__ == "__main__":
    main()
