"""Paged decode attention alone, at a model's attention shape and a decode step's batch and context, with
no help from L2: each call of a timed chain reads its own copy of the batch's pages (a decode step reads
a layer's K/V once, after the weights have flushed L2; `bench_kernels`' chain rereads one set).

Variants (launch parameters) are timed round-robin in one
process, `--rounds` times each, so drifting memory clocks hit them alike; the JSON keeps every round and
the median. Bandwidth is K+V bytes over the device time, against the copy rate measured in the same run.

    python -m benchmarks.bench_decode_attention --shape qwen3-4b --batch-sizes 1 8 32 --context 1088 \
        --sweep --out benchmarks/results/decode_attention_qwen3-4b_h100.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks.common import environment, write_result
from benchmarks.roofline import measure_copy_bandwidth
from jinfer.config.model import NAMED_SHAPES
from pallas_kernels.attention.paged_attention import paged_decode_attention, paged_decode_attention_reference

CHAIN = 8  # calls per timed jit, each on its own pages


def variants(batch: int, sweep: bool) -> list[dict]:
    """Keyword sets for paged_decode_attention ({} = its defaults)."""
    out: list[dict] = [{}]
    if not sweep:
        return out
    for ppb, stages in ((2, 3), (2, 4), (4, 2), (4, 3), (4, 4), (8, 2), (8, 3)):
        out.append({"pages_per_block": ppb, "num_stages": stages})
    splits = (8, 16, 32) if batch == 1 else (3, 5, 8) if batch <= 8 else (1, 2, 3)
    for s in splits:
        for ppb, stages in ((4, 3), (8, 2)):
            out.append({"pages_per_block": ppb, "num_stages": stages, "num_splits": s})
    return out


PLACEMENTS = ("contiguous", "shuffled", "random")


def inputs(batch, context, heads, kv_heads, dim, page, chain, placement, dtype=jnp.bfloat16):
    """q, K/V caches holding `chain` disjoint sets of the batch's pages, and one page table per set
    [chain, batch, pages per seq]. Placement of a sequence's pages: `contiguous` (a fresh engine's prefill),
    `shuffled` (its own contiguous range in random order), `random` (anywhere in the cache: a long-running
    server's free queue)."""
    per_seq = -(-context // page)
    pages = chain * batch * per_seq
    kq, kk, kv, kp = jax.random.split(jax.random.key(batch), 4)
    q = jax.random.normal(kq, (batch, heads, dim), dtype)
    k = jax.random.normal(kk, (pages, page, kv_heads, dim), dtype)
    v = jax.random.normal(kv, (pages, page, kv_heads, dim), dtype)
    ids = jnp.arange(pages, dtype=jnp.int32).reshape(chain, batch, per_seq)
    if placement == "random":
        ids = jax.random.permutation(kp, pages).reshape(chain, batch, per_seq)
    elif placement == "shuffled":
        ids = jax.random.permutation(kp, ids, axis=2, independent=True)
    tables = ids.astype(jnp.int32)
    lens = jnp.full((batch,), context, jnp.int32)
    return q, k, v, tables, lens


def chained(fn, chain):
    @jax.jit
    def run(q, k, v, tables, lens):
        for i in range(chain):  # each call's output is the next call's query: a true dependency
            q = fn(q, k, v, tables[i], lens)
        return q

    return run


def time_once(run, args, iters) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        out = run(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def kernel_times(run, args, chain) -> dict:
    """Per-call device time of each kernel of one profiled chain (no launch gaps, unlike `us`)."""
    import tempfile

    from benchmarks.trace_summary import gpu_kernel_times

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(run(*args))
        per, _ = gpu_kernel_times(trace_dir, chain)
    attn = sum(v for k, v in per.items() if k.startswith("paged_decode_attention"))
    return {"kernels_us": {k: round(v, 2) for k, v in per.items()}, "kernel_us": round(sum(per.values()), 2),
            "attention_kernel_us": round(attn, 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(NAMED_SHAPES))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=1088, help="tokens per sequence (1k prompt + half of 128 out)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--placement", nargs="+", default=["contiguous"], choices=PLACEMENTS,
                    help="where each sequence's pages lie in the cache (see `inputs`)")
    ap.add_argument("--sweep", action="store_true", help="a grid of launch parameters")
    ap.add_argument("--variants", type=json.loads, metavar="JSON",
                    help='the variants to time instead, a JSON list of keyword sets, e.g. \'[{}, {"num_splits": 4}]\'')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kernel-times", action="store_true",
                    help="also profile one chain per variant: device time per kernel (launch gaps excluded)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes in interpret mode (checks the script)")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = NAMED_SHAPES[args.shape]
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    chain, interpret = CHAIN, False
    if args.smoke:
        args.batch_sizes, args.context, chain, interpret, args.rounds = [2], 40, 2, True, 1
    copy = measure_copy_bandwidth() if not args.smoke else {"best_Bps": float("nan")}
    result = {"benchmark": "decode_attention", **environment(), "shape": args.shape, "heads": heads,
              "kv_heads": kv_heads, "head_dim": dim, "page_size": args.page_size, "context": args.context,
              "copy_bandwidth": copy, "chain": chain,
              "timing": "device time per call: a jit of `chain` dependent calls, each on its own pages, "
                        "timed back to back; median over rounds (variants interleaved)", "rows": []}
    for batch, placement in ((b, p) for b in args.batch_sizes for p in args.placement):
        q, k, v, tables, lens = inputs(batch, args.context, heads, kv_heads, dim, args.page_size, chain, placement)
        kv_bytes = 2 * batch * args.context * kv_heads * dim * k.dtype.itemsize
        ref = paged_decode_attention_reference(q, k, v, tables[0], lens).astype(jnp.float32)
        rows = []
        for kw in args.variants if args.variants is not None else variants(batch, args.sweep):
            row = {"batch_size": batch, "placement": placement, "variant": kw, "kv_bytes": kv_bytes, "us_runs": []}
            try:
                fn = functools.partial(paged_decode_attention, interpret=interpret, **kw)
                out = fn(q, k, v, tables[0], lens).astype(jnp.float32)
                row["max_abs_err"] = float(jnp.abs(out - ref).max())
                row["run"] = chained(fn, chain)
                row["args"] = (q, k, v, tables, lens)
                single = time_once(row["run"], row["args"], 1)
                time_once(row["run"], row["args"], 1)
                row["iters"] = max(2, min(200, int(0.03 / max(single, 1e-6))))
            except Exception as e:  # a launch configuration that does not compile is recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
        for _ in range(args.rounds):
            for row in rows:
                if "run" in row:
                    row["us_runs"].append(time_once(row["run"], row["args"], row["iters"]) / chain * 1e6)
        for row in rows:
            if args.kernel_times and "run" in row:
                row.update(kernel_times(row["run"], row["args"], chain))
            row.pop("run", None), row.pop("args", None)
            if row["us_runs"]:
                us = statistics.median(row["us_runs"])
                row["us"] = round(us, 2)
                row["tb_per_s"] = round(kv_bytes / us / 1e6, 3)
                row["frac_of_copy_rate"] = round(kv_bytes / us / 1e-6 / copy["best_Bps"], 3) if not args.smoke \
                    else None
            if row.get("attention_kernel_us"):
                row["attention_kernel_tb_per_s"] = round(kv_bytes / row["attention_kernel_us"] / 1e6, 3)
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
        del k, v
    write_result(result, args.out)


if __name__ == "__main__":
    main()
