"""Time the raw forward pass (no engine): compile time and steady-state step time for a prefill and
for decode steps, at a named real shape with dummy weights.

Decode is timed two ways: `decode_step_ms_*` syncs every step (host work and launches included, as a
naive loop sees it), `decode_pipelined_ms` dispatches all steps with their inputs already on the
device and syncs once (the device's own time per step once the host runs ahead: what an engine
that overlaps host and device can reach). With the Pallas kernels at batch > 1 the decode steps run as
the engine's decode-only executables (paged decode kernel); `decode_pipelined_ms_ragged_attention`
times the same steps with the ragged prefill kernel's attention (the path of mixed steps); the two
alternate over 5 passes each and report medians.

    python -m benchmarks.bench_forward --shape qwen3-4b --prompt-len 1024 --batch 1 --out results/x.json
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import add_profile_argument, environment, profiled, write_result
from jinfer.config.kernels import KernelPolicy
from jinfer.models.batch import make_batch
from jinfer.models.llama import forward, fuse_qkv
from jinfer.ops import select_ops
from jinfer.weights.loader import DTYPES, load_weights, resolve_model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--attention-backend", default="auto", help="auto | reference | pallas | pallas-triton")
    ap.add_argument("--num-pages", type=int, help="KV pool size (default: just what the batch needs); a serving-size "
                    "pool shows whether the KV update is done in place")
    ap.add_argument("--dump-hlo", metavar="DIR", help="write the optimized HLO of the prefill and decode executables")
    add_profile_argument(ap)
    ap.add_argument("--out")
    args = ap.parse_args()

    src = resolve_model(f"dummy:{args.shape}")
    cfg = src.config
    t0 = time.perf_counter()
    w = fuse_qkv(load_weights(src, args.dtype, progress=False))  # as the engine does on one device
    jax.block_until_ready(w)
    load_s = time.perf_counter() - t0
    pages_per_seq = (args.prompt_len + args.iters + 2) // args.page_size + 1
    num_pages = max(pages_per_seq * args.batch + 1, args.num_pages or 0)  # page 0 is reserved
    shape = (num_pages, args.page_size, cfg.num_kv_heads, cfg.head_dim)
    kv = tuple((jnp.zeros(shape, DTYPES[args.dtype]), jnp.zeros(shape, DTYPES[args.dtype]))
               for _ in range(cfg.num_layers))
    pages = [list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)) for b in range(args.batch)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    ops = select_ops(policy=KernelPolicy.from_env(attention_backend=args.attention_backend))
    step = jax.jit(partial(forward, cfg=cfg, ops=ops), donate_argnames=("kv_cache",))

    prefill = make_batch([(p, 0, pg) for p, pg in zip(prompts, pages)], args.page_size)
    t0 = time.perf_counter()
    compiled_prefill = step.lower(w, prefill, kv).compile()
    prefill_compile_s = time.perf_counter() - t0
    # Re-running prefill over the same slots is harmless for timing: the first run is a warm-up.
    prefill = jax.device_put(prefill)
    logits, kv = compiled_prefill(w, prefill, kv)
    jax.block_until_ready(logits)
    times = []
    with profiled(args.profile and f"{args.profile}/prefill"):
        for _ in range(3):
            t = time.perf_counter()
            logits, kv = compiled_prefill(w, prefill, kv)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t)
    prefill_s = float(np.median(times))

    # Decode steps as the engine runs them: with the Pallas kernels, a decode-only executable whose
    # attention is the paged decode kernel (`ModelOps.decode_step`); batch 1 gets it from its shape.
    decode_ops = replace(ops, decode_step=True) if ops.backend == "pallas" else ops
    decode_step = jax.jit(partial(forward, cfg=cfg, ops=decode_ops), donate_argnames=("kv_cache",))
    decode = lambda i: make_batch([([1], args.prompt_len + i, pg) for pg in pages], args.page_size,
                                  pages_per_seq=pages_per_seq)
    t0 = time.perf_counter()
    compiled_decode = decode_step.lower(w, decode(0), kv).compile()
    decode_compile_s = time.perf_counter() - t0
    if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        for name, c in (("prefill", compiled_prefill), ("decode", compiled_decode)):
            with open(f"{args.dump_hlo}/{name}.hlo.txt", "w") as f:
                f.write(c.as_text())
    times = []
    with profiled(args.profile and f"{args.profile}/decode"):  # the decode steps
        for i in range(args.iters):
            b = decode(i)
            t = time.perf_counter()
            logits, kv = compiled_decode(w, b, kv)
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t)
    batches = [jax.device_put(decode(i)) for i in range(args.iters)]

    def pipelined(fn, kv):
        jax.block_until_ready((batches, kv))
        t = time.perf_counter()
        for b in batches:
            logits, kv = fn(w, b, kv)
        jax.block_until_ready(logits)
        return (time.perf_counter() - t) / args.iters * 1e3, kv

    extra = {}
    if decode_ops is not ops and args.batch > 1:  # the same steps with the ragged kernel's attention
        ragged = step.lower(w, batches[0], kv).compile()
        logits, kv = ragged(w, batches[0], kv)  # warm-up
        # Alternating passes (5 each, medians): a lone short pass drifts by a few % with the clocks.
        runs: dict = {"decode": [], "ragged": []}
        for _ in range(5):
            for name, fn in (("decode", compiled_decode), ("ragged", ragged)):
                ms, kv = pipelined(fn, kv)
                runs[name].append(ms)
        pipelined_ms = float(np.median(runs["decode"]))
        extra = {"decode_pipelined_ms_runs": runs["decode"],
                 "decode_pipelined_ms_ragged_attention": float(np.median(runs["ragged"])),
                 "decode_pipelined_ms_ragged_attention_runs": runs["ragged"]}
    else:
        pipelined_ms, kv = pipelined(compiled_decode, kv)
    result = {
        "benchmark": "forward", **environment(), "shape": args.shape, "dtype": args.dtype,
        "batch_size": args.batch, "prompt_len": args.prompt_len, "page_size": args.page_size, "num_pages": num_pages,
        "attention_backend": ops.backend, "mosaic_prefill": ops.mosaic_prefill,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "weights_load_s": load_s, "prefill_compile_s": prefill_compile_s, "prefill_step_ms": prefill_s * 1e3,
        "decode_compile_s": decode_compile_s, "decode_step_ms_median": float(np.median(times[1:])) * 1e3,
        "decode_step_ms_min": float(np.min(times)) * 1e3, "decode_pipelined_ms": pipelined_ms, **extra,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
