"""Quick timings of the attention kernels (the full comparison is benchmarks/bench_kernels.py).

    python -m benchmarks.kernels.bench_attention decode        # paged decode attention, 64 x 2k context
    python -m benchmarks.kernels.bench_attention prefill       # ragged prefill (Triton), one causal 4k prompt
    python -m benchmarks.kernels.bench_attention prefill_mgpu  # the same on the Mosaic GPU kernel
    python -m benchmarks.kernels.bench_attention mla_decode [--sweep] [--out JSON]  # MLA decode, 32 x 4k context
    python -m benchmarks.kernels.bench_attention mla_prefill [--out JSON]  # MLA chunks: expanded vs absorbed vs jnp

On CPU: tiny shapes in the interpreters, to check the script.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.kernels import run_subcommand
from pallas_kernels.attention.paged_attention import paged_decode_attention
from pallas_kernels.attention.prefill_attention import ragged_prefill_attention
from pallas_kernels.attention.prefill_attention_mgpu import ragged_prefill_attention_mgpu


def bench_decode(argv: list[str] | None = None) -> None:
    """Paged decode attention: batch 64 x 2048 tokens of context, Qwen3-4B's heads."""
    import time

    batch, ctx, heads, kv_heads, dim, page = 64, 2048, 32, 8, 128, 16
    interpret = jax.default_backend() != "gpu"
    if interpret:
        batch, ctx = 2, 256
    pages = batch * ctx // page
    key = jax.random.key(0)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, heads, dim), jnp.bfloat16)
    k = jax.random.normal(kk, (pages, page, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(kv, (pages, page, kv_heads, dim), jnp.bfloat16)
    table = jax.random.permutation(key, pages).reshape(batch, ctx // page).astype(jnp.int32)
    lens = jnp.full((batch,), ctx, jnp.int32)
    fn = functools.partial(paged_decode_attention, interpret=interpret)
    fn(q, k, v, table, lens).block_until_ready()
    n = 3 if interpret else 50
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(q, k, v, table, lens)
    out.block_until_ready()
    dt = (time.perf_counter() - t0) / n
    gb = 2 * k.size * k.dtype.itemsize / 1e9
    print(f"paged_decode_attention B={batch} ctx={ctx}: {dt * 1e6:.1f} us, {gb / dt / 1e3:.2f} TB/s")


def time_causal_prefill(fn, name: str, interpret: bool) -> None:
    """Print the time and TFLOP/s of `fn(q, k, v, query_start, seq_lens, page_table)` on one causal
    prompt (4096 tokens, Qwen3-4B heads; 128 under the interpreter). Shared by the modules' main()."""
    import time

    n, heads, kv_heads, dim, page = (128 if interpret else 4096), 32, 8, 128, 16
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (n, heads, dim), jnp.bfloat16)
    k = jax.random.normal(kk, (n // page, page, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(kv, (n // page, page, kv_heads, dim), jnp.bfloat16)
    args = (q, k, v, jnp.array([0, n], jnp.int32), jnp.array([n], jnp.int32),
            jnp.arange(n // page, dtype=jnp.int32)[None])
    fn(*args).block_until_ready()
    reps = 2 if interpret else 20
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    dt = (time.perf_counter() - t0) / reps
    flops = 4 * n * n / 2 * heads * dim
    print(f"{name} causal {n}: {dt * 1e6:.1f} us, {flops / dt / 1e12:.1f} TFLOP/s")


def bench_prefill(argv: list[str] | None = None) -> None:
    """Quick causal-prefill timing; the full comparison is benchmarks/bench_kernels.py."""
    interpret = jax.default_backend() != "gpu"
    time_causal_prefill(functools.partial(ragged_prefill_attention, interpret=interpret),
                        "ragged_prefill_attention", interpret)


def bench_prefill_mgpu(argv: list[str] | None = None) -> None:
    """Quick causal-prefill timing of the Mosaic GPU kernel."""
    interpret = jax.default_backend() != "gpu"
    time_causal_prefill(functools.partial(ragged_prefill_attention_mgpu, interpret=interpret),
                        "ragged_prefill_attention_mgpu", interpret)


def mla_variants(heads: int, sweep: bool) -> list[dict]:
    """Keyword sets for mla_decode_attention ({} = its defaults) at batch 32."""
    out: list[dict] = [{}]
    if sweep:
        out += [{"block_n": n, "num_stages": st} for n in (16, 32, 64) for st in (2, 3, 4) if (n, st) != (32, 2)]
        out += [{"num_splits": s} for s in ((4, 6, 12, 16) if heads <= 16 else (1, 2, 4))]
        if heads > 16:
            out += [{"block_h": h, "num_warps": w} for h in (16, 32, 64) for w in (4, 8)]
    return out


def bench_mla_decode(argv: list[str] | None = None) -> None:
    """MLA decode attention (absorbed form, 512 + 64 latent rows, bf16) at batch 32 x 4k context: latent-cache bytes
    read per second of device time (issue target: >= 2.6 TB/s on an H100), against the copy rate of the same run.
    Each call of a timed chain reads its own randomly placed pages (a decode step finds the cache cold in L2);
    variants are timed round-robin, median over rounds. On CPU: a tiny case in the interpreter, to check the script."""
    import argparse
    import json
    import statistics
    import time

    from benchmarks.common import environment, write_result
    from benchmarks.roofline import measure_copy_bandwidth
    from pallas_kernels.attention.mla_decode import mla_decode_attention, mla_decode_attention_reference

    ap = argparse.ArgumentParser(prog="bench_attention mla_decode")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128],
                    help="per device: 16 = DeepSeek-V2-Lite or V3 at tp 8; 128 = V3 on one device (data-parallel attn)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sweep", action="store_true", help="a grid of launch parameters")
    ap.add_argument("--variants", type=json.loads, metavar="JSON",
                    help='keyword sets instead, e.g. \'[{}, {"num_splits": 4}]\'')
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    rank, rope, chain, iters = 512, 64, 8, 5
    if interpret:
        args.batch, args.context, args.heads, args.rounds, chain, iters = 2, 64, [16], 1, 2, 1
    page, batch, ctx = args.page_size, args.batch, args.context
    scale = 192**-0.5  # DeepSeek's (128 + 64) ** -0.5
    result = {"benchmark": "mla_decode_attention", **environment(), "batch": batch, "context": ctx, "page_size": page,
              "kv_lora_rank": rank, "rope_dim": rope, "chain": chain, "target_TBps_h100": 2.6,
              "copy_bandwidth": None if interpret else measure_copy_bandwidth(),
              "timing": "wall time of a jit of `chain` calls on disjoint random pages / chain, median over rounds",
              "rows": []}
    per_seq = -(-ctx // page)
    for heads in args.heads:
        kq, kl, kp = jax.random.split(jax.random.key(heads), 3)
        q = jax.random.normal(kq, (batch, heads, rank + rope), jnp.bfloat16)
        latent = jax.random.normal(kl, (chain * batch * per_seq, page, rank + rope), jnp.bfloat16)
        tables = jax.random.permutation(kp, latent.shape[0]).reshape(chain, batch, per_seq).astype(jnp.int32)
        lens = jnp.full((batch,), ctx, jnp.int32)
        latent_bytes = batch * ctx * (rank + rope) * latent.dtype.itemsize  # each row read once per call
        ref = mla_decode_attention_reference(q, latent, tables[0], lens, kv_lora_rank=rank, scale=scale)
        runs = []
        for kw in args.variants if args.variants is not None else mla_variants(heads, args.sweep):
            fn = functools.partial(mla_decode_attention, kv_lora_rank=rank, scale=scale, interpret=interpret, **kw)
            run = jax.jit(lambda q, lat, tables, lens, fn=fn: tuple(fn(q, lat, tables[i], lens) for i in range(chain)))
            err = float(jnp.abs(run(q, latent, tables, lens)[0].astype(jnp.float32) - ref.astype(jnp.float32)).max())
            runs.append((kw, run, err, []))
        for _ in range(args.rounds):  # variants interleaved: drifting clocks hit them alike
            for _, run, _, times in runs:
                jax.block_until_ready(run(q, latent, tables, lens))
                t0 = time.perf_counter()
                for _ in range(iters):
                    out = run(q, latent, tables, lens)
                jax.block_until_ready(out)
                times.append((time.perf_counter() - t0) / iters / chain)
        for kw, _, err, times in runs:
            us = statistics.median(times) * 1e6
            row = {"heads": heads, "variant": kw, "latent_bytes": latent_bytes, "us": round(us, 2),
                   "us_runs": [round(t * 1e6, 2) for t in times], "TBps": round(latent_bytes / us / 1e6, 3),
                   "max_abs_err": err}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    write_result(result, args.out)


def bench_mla_prefill(argv: list[str] | None = None) -> None:
    """`ModelOps.mla_attention` (DeepSeek-V2-Lite's 16 heads, 512 + 64 latent, nope 128, v 128, bf16) on prefill steps
    (new tokens x cached tokens before them, per sequence) under each MLA policy: mla_expand_min_query_len 0
    ("absorbed": every sequence absorbed), 16 / 64 / 256, and the jnp reference (mla_ragged_kernel off): ms a call, and
    the max difference from the reference (or from "absorbed" where the reference ran out of memory). The measurement
    behind KernelPolicy.mla_expand_min_query_len's default."""
    import argparse
    import json
    import statistics
    import time

    from benchmarks.common import environment, write_result
    from jinfer.config.kernels import KernelPolicy
    from jinfer.models.batch import make_batch
    from jinfer.ops import ModelOps

    ap = argparse.ArgumentParser(prog="bench_attention mla_prefill")
    ap.add_argument("--cases", type=json.loads, metavar="JSON", default=[[[1024, 0]] * 2, [[2048, 0]], [[2048, 6144]],
                                                                          [[256, 2048]] * 8, [[32, 4096]] * 16],
                    help="steps: lists of [new tokens, cached tokens] per sequence")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    interpret = jax.default_backend() != "gpu"
    heads, rank, rope, nope, dv, page, dtype = 16, 512, 64, 128, 128, 16, jnp.bfloat16
    if interpret:
        args.cases, args.rounds, heads, rank, nope, dv, dtype = [[[20, 0], [9, 30]]], 1, 4, 32, 16, 16, jnp.float32
    policies = {f"expand>={n}" if n else "absorbed": KernelPolicy(mla_expand_min_query_len=n) for n in (0, 16, 64, 256)}
    policies["reference"] = KernelPolicy(mla_ragged_kernel=False)
    result = {"benchmark": "mla_attention_prefill", **environment(), "heads": heads, "kv_lora_rank": rank,
              "rope_dim": rope, "rows": []}
    for case in args.cases:
        seqs, first = [], 1
        for new, cached in case:
            n_pages = -(-(new + cached) // page)
            seqs.append(([1] * new, cached, list(range(first, first + n_pages))))
            first += n_pages
        tokens = sum(n for n, _ in case)
        batch = jax.tree.map(jnp.asarray, make_batch(seqs, page))
        k = jax.random.split(jax.random.key(tokens), 5)
        latent = jax.random.normal(k[0], (first, page, rank + rope), dtype)
        args_ = (jax.random.normal(k[1], (tokens, heads, nope), dtype), jax.random.normal(k[2], (tokens, heads, rope),
                 dtype), latent.reshape(-1, rank + rope)[batch.slot_mapping],
                 jax.random.normal(k[3], (rank, heads, nope + dv), dtype) * rank**-0.5, latent, batch)
        runs = {}
        for name, policy in policies.items():
            ops = ModelOps("pallas", interpret=interpret, policy=policy)
            runs[name] = jax.jit(functools.partial(ops.mla_attention, scale=192**-0.5))
        outs = {}
        for name, run in list(runs.items()):
            try:
                outs[name] = jax.block_until_ready(run(*args_))
            except Exception as e:  # the jnp reference's gathers of a long context can exceed the GPU's memory
                print(json.dumps({"seqs": case, "policy": name, "error": str(e)[:200]}), flush=True)
                del runs[name]
        base = outs.get("reference", outs["absorbed"])
        times = {name: [] for name in runs}
        for _ in range(args.rounds):  # policies interleaved
            for name, run in runs.items():
                jax.block_until_ready(run(*args_))
                t0 = time.perf_counter()
                jax.block_until_ready(run(*args_))
                times[name].append(time.perf_counter() - t0)
        for name in runs:
            err = float(jnp.abs(outs[name].astype(jnp.float32) - base.astype(jnp.float32)).max())
            row = {"seqs": case, "policy": name, "ms": round(statistics.median(times[name]) * 1e3, 3),
                   "max_abs_err": err}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
    write_result(result, args.out)


BENCHMARKS = {"decode": bench_decode, "prefill": bench_prefill, "prefill_mgpu": bench_prefill_mgpu,
              "mla_decode": bench_mla_decode, "mla_prefill": bench_mla_prefill}

def main(argv: list[str] | None = None) -> None:
    run_subcommand(BENCHMARKS, __spec__.name, __doc__, argv)


if __name__ == "__main__":
    main()
