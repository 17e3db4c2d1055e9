"""Kernel benchmarks on the GPU: paged decode attention, ragged prefill attention, fused SwiGLU MLP.

Measures our Pallas kernels side by side with their peers at Qwen3-4B attention heads (32 query,
8 KV, head_dim 128, page 16) and MLP shapes (hidden 2560, intermediate 9728), bf16:
- decode: (batch 1, 8k ctx), (64, 2k), (256, 1k): time and achieved K/V bandwidth (K+V bytes read
  / time) vs the jnp reference under XLA, JAX's deprecated Pallas-Triton
  `jax.experimental.pallas.ops.gpu.paged_attention` (its own [kv_heads, pages, page, D] layout,
  transposed outside the timed region) and cuDNN `jax.nn.dot_product_attention` on contiguous K/V;
- prefill: causal TFLOP/s at 1k, 4k, 16k tokens vs XLA and cuDNN dot_product_attention (contiguous);
- MLP: time vs XLA for 1..2048 tokens.
`time_us` is device time per call: one jit chains 10 calls (each call's output is the next one's
query / activations) and the chain is timed warm, median of 5 runs of back-to-back executions with
`block_until_ready`; `wall_us` is the per-call time of separate dispatches from Python (host
overhead included). `--sweep [all|triton|mgpu]` also times a grid of launch parameters.

  python benchmarks/bench_kernels.py --out benchmarks/results/kernels_h100.json [--sweep] [--repeat N]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pallas_kernels.attention.paged_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
)
from pallas_kernels.attention.prefill_attention import ragged_prefill_attention  # noqa: E402
from pallas_kernels.attention.prefill_attention_mgpu import ragged_prefill_attention_mgpu  # noqa: E402
from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp, fused_swiglu_mlp_reference  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16
DTYPE = jnp.bfloat16
COPY_BW = 2.9e12  # measured HBM copy bandwidth of the H100 machine (gpu/README.md)
MATMUL_PEAK = 780e12  # measured bf16 matmul peak (8192^3)
# shapes per benchmark; --smoke shrinks them and runs the kernels in interpret mode (CPU check)
SHAPES = {"decode": ((1, 8192), (64, 2048), (256, 1024)), "prefill": (1024, 4096, 16384),
          "mlp": ((2560, 9728), (1, 16, 64, 256, 2048)), "mixed": (64, 2048),
          "route": ((8, 16, 32, 64, 128, 256), (512, 1024, 2048, 4096))}
SMOKE_SHAPES = {"decode": ((1, 256), (2, 128)), "prefill": (64,), "mlp": ((128, 256), (1, 16)),
                "mixed": (2, 64), "route": ((2,), (64,))}
KW: dict = {}  # extra kernel kwargs ({"interpret": True} under --smoke)


CHAIN = 10  # calls per jitted chain for the device-time figure


def timeit(fn, *args, target_s: float = 0.05) -> float:
    """Median seconds per call over 5 runs of back-to-back calls (after compile + warm-up)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    single = time.perf_counter() - t0
    iters = int(min(500, max(3, target_s / max(single, 1e-6))))
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / iters)
    return statistics.median(runs)


def chained(fn, n: int = CHAIN):
    """One jit running `x = fn(x, *rest)` n times: per-call device time without host dispatch.

    Every benchmarked function returns an array shaped like its first argument (q, or x for the
    MLP), so the chain is a true data dependency that XLA cannot hoist or overlap.
    """

    @jax.jit
    def run(x, *rest):
        for _ in range(n):
            x = fn(x, *rest)
        return x

    return run


def attempt(record: list, entry: dict, fn, *args, wall: bool = True, **kw) -> float | None:
    """Time fn (device time from a chain of calls; also per-call dispatch wall time unless wall=False),
    append entry (+ times or error) to record; return device seconds per call or None."""
    try:
        dt = timeit(chained(fn), *args, **kw) / CHAIN
        entry["time_us"] = round(dt * 1e6, 2)
        if wall:
            entry["wall_us"] = round(timeit(fn, *args, **kw) * 1e6, 2)
    except Exception as e:  # a peer that does not apply (shape/layout limits) is recorded, not fatal
        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        dt = None
    record.append(entry)
    print(json.dumps(entry), flush=True)
    return dt


def reference_unhoisted(q, k, v, table, lens):
    """The jnp reference with page ids that (formally) depend on q: every call of the timing chain
    gathers its pages again instead of XLA hoisting one shared gather out of the chain."""
    bump = (q[0, 0, 0] > 1e30).astype(jnp.int32)  # always 0
    return paged_decode_attention_reference(q, k, v, table + bump, lens)


# ----------------------------------------------------------------------------------------------
def decode_inputs(batch: int, ctx: int):
    """q, K and V caches with each sequence's pages at random places, page table, lengths, K+V bytes."""
    pages = batch * ctx // PAGE
    kq, kk, kv, kp = jax.random.split(jax.random.key(batch), 4)
    q = jax.random.normal(kq, (batch, HEADS, DIM), DTYPE)
    k = jax.random.normal(kk, (pages, PAGE, KV_HEADS, DIM), DTYPE)
    v = jax.random.normal(kv, (pages, PAGE, KV_HEADS, DIM), DTYPE)
    table = jax.random.permutation(kp, pages).reshape(batch, ctx // PAGE).astype(jnp.int32)
    lens = jnp.full((batch,), ctx, jnp.int32)
    return q, k, v, table, lens, 2 * batch * ctx * KV_HEADS * DIM * 2


def bench_decode(results: list, sweep: str | None) -> None:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    for batch, ctx in SHAPES["decode"]:
        q, k, v, table, lens, kv_bytes = decode_inputs(batch, ctx)
        shape = {"kernel": "decode", "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes}

        def add(impl, fn, *args, shape=shape, kv_bytes=kv_bytes, wall=True, **params):
            entry = {**shape, "impl": impl, **params}
            dt = attempt(results, entry, fn, *args, wall=wall)
            if dt:
                entry["tb_per_s"] = round(kv_bytes / dt / 1e12, 3)
                entry["frac_copy_bw"] = round(kv_bytes / dt / COPY_BW, 3)

        ref = paged_decode_attention_reference(q, k, v, table, lens)
        ours = paged_decode_attention(q, k, v, table, lens, **KW)
        shape["max_abs_err_vs_ref"] = float(jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32)).max())
        add("pallas_decode(default)", functools.partial(paged_decode_attention, **KW), q, k, v, table, lens)
        for ppb in (2, 4):  # the two block sizes the default picks between (32 / 64 tokens)
            add("pallas_decode", functools.partial(paged_decode_attention, pages_per_block=ppb, **KW), q, k, v,
                table, lens, pages_per_block=ppb, wall=False)
        if sweep in ("all", "triton"):
            if batch == 1:
                configs = [(ppb, s, st, 4, hf) for ppb in (4, 8, 16) for s in (16, 32) for st in (2, 4)
                           for hf in (True, False)]
            else:
                configs = [(ppb, 1, st, w, True) for ppb in (2, 4, 8) for st in (2, 3, 4) for w in (2, 4)]
                configs += [(4, 1, 2, 4, False), (4, 1, 3, 4, False), (4, 2, 2, 4, True)]
            for ppb, s, stages, warps, hf in configs:
                fn = functools.partial(paged_decode_attention, pages_per_block=ppb, num_splits=s,
                                       num_stages=stages, num_warps=warps, kv_heads_fastest=hf, **KW)
                add("pallas_decode", fn, q, k, v, table, lens, pages_per_block=ppb, num_splits=s,
                    num_stages=stages, num_warps=warps, kv_heads_fastest=hf, wall=False)
        add("jnp_reference_xla", reference_unhoisted, q, k, v, table, lens)

        k_t = jnp.transpose(k, (2, 0, 1, 3))  # JAX's layout [kv_heads, pages, page, D], untimed
        v_t = jnp.transpose(v, (2, 0, 1, 3))
        for ks in (8, 16):
            fn = functools.partial(jax_paged.paged_attention, k_splits=ks, **KW)
            add("jax_pallas_triton_paged_attention", fn, q, k_t, v_t, table, lens, k_splits=ks)
        del k_t, v_t

        k_c = k[table].reshape(batch, ctx, KV_HEADS, DIM)  # contiguous copy for cuDNN, untimed
        v_c = v[table].reshape(batch, ctx, KV_HEADS, DIM)
        cudnn = jax.jit(lambda q, k, v, lens: jax.nn.dot_product_attention(
            q[:, None], k, v, key_value_seq_lengths=lens, implementation="cudnn")[:, 0])
        add("cudnn_dot_product_attention(contiguous)", cudnn, q, k_c, v_c, lens)
        del k_c, v_c, k, v


# ----------------------------------------------------------------------------------------------
def bench_prefill(results: list, sweep: str | None) -> None:
    for n in SHAPES["prefill"]:
        key = jax.random.key(n)
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (n, HEADS, DIM), DTYPE)
        k = jax.random.normal(kk, (n // PAGE, PAGE, KV_HEADS, DIM), DTYPE)
        v = jax.random.normal(kv, (n // PAGE, PAGE, KV_HEADS, DIM), DTYPE)
        table = jnp.arange(n // PAGE, dtype=jnp.int32)[None]
        qs = jnp.array([0, n], jnp.int32)
        lens = jnp.array([n], jnp.int32)
        flops = 4 * n * n / 2 * HEADS * DIM  # causal: half of QK^T and PV
        shape = {"kernel": "prefill", "tokens": n, "causal_flops": flops}

        def add(impl, fn, *args, shape=shape, flops=flops, wall=True, **params):
            entry = {**shape, "impl": impl, **params}
            dt = attempt(results, entry, fn, *args, wall=wall, target_s=0.1)
            if dt:
                entry["tflop_per_s"] = round(flops / dt / 1e12, 1)

        add("pallas_prefill(default)", functools.partial(ragged_prefill_attention, **KW),
            q, k, v, qs, lens, table)
        add("mosaic_gpu_prefill(default)", functools.partial(ragged_prefill_attention_mgpu, **KW),
            q, k, v, qs, lens, table)
        if sweep in ("all", "mgpu"):
            # num_ctas None: one persistent CTA per SM; 2**20: one (head, tile) item per CTA
            sms = jax.devices()[0].core_count
            for bkv, steps, qb, ctas in ((128, 2, 2, 2**20), (128, 3, 1, None), (128, 2, 1, None), (64, 3, 2, None)):
                fn = functools.partial(ragged_prefill_attention_mgpu, block_kv=bkv, max_steps=steps,
                                       q_buffers=qb, num_ctas=ctas, **KW)
                add("mosaic_gpu_prefill", fn, q, k, v, qs, lens, table, block_kv=bkv, max_steps=steps,
                    q_buffers=qb, num_ctas=ctas or sms, wall=False)
        if sweep in ("all", "triton"):
            for bq, ppb, warps, stages, hf in ((32, 4, 4, 2, False), (32, 4, 4, 3, True),
                                               (32, 8, 8, 3, True), (32, 8, 8, 2, True), (64, 8, 8, 2, True),
                                               (32, 4, 8, 3, True), (64, 4, 8, 2, True)):
                fn = functools.partial(ragged_prefill_attention, block_q=bq, pages_per_block=ppb,
                                       num_warps=warps, num_stages=stages, kv_heads_fastest=hf, **KW)
                add("pallas_prefill", fn, q, k, v, qs, lens, table, block_q=bq, pages_per_block=ppb,
                    num_warps=warps, num_stages=stages, kv_heads_fastest=hf, wall=False)
        k_c = k.reshape(1, n, KV_HEADS, DIM)
        v_c = v.reshape(1, n, KV_HEADS, DIM)
        for impl in ("cudnn", "xla"):
            fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                q[None], k, v, is_causal=True, implementation=impl)[0])
            if impl == "xla" and n > 4096:
                results.append({**shape, "impl": "xla_dot_product_attention", "skipped": "O(n^2) memory"})
                continue
            add(f"{impl}_dot_product_attention(contiguous)", fn, q, k_c, v_c)
        if n == SHAPES["prefill"][0]:  # correctness spot check at GPU precision vs XLA
            ref = jax.nn.dot_product_attention(q[None], k_c, v_c, is_causal=True, implementation="xla")[0]
            for name, fn in (("pallas_prefill", ragged_prefill_attention),
                             ("mosaic_gpu_prefill", ragged_prefill_attention_mgpu)):
                ours = fn(q, k, v, qs, lens, table, **KW)
                err = jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32)).max()
                results[-1][f"max_abs_err_{name}_vs_xla"] = float(err)

    # Decode batches through the ragged (Triton) prefill kernel, as the engine runs them (T > 1), on
    # the decode benchmark's inputs: distinct K and V, randomly placed pages.
    for batch, ctx in SHAPES["decode"]:
        if batch == 1:  # T = 1 takes the split-K decode kernel
            continue
        q, k, v, table, lens, kv_bytes = decode_inputs(batch, ctx)
        qs = jnp.arange(batch + 1, dtype=jnp.int32)
        entry = {"kernel": "decode_via_prefill_kernel", "batch": batch, "ctx": ctx, "impl": "pallas_prefill"}
        dt = attempt(results, entry, functools.partial(ragged_prefill_attention, **KW), q, k, v, qs, lens, table)
        if dt:
            entry["tb_per_s"] = round(kv_bytes / dt / 1e12, 3)
            entry["frac_copy_bw"] = round(kv_bytes / dt / COPY_BW, 3)


# ----------------------------------------------------------------------------------------------
def bench_mixed(results: list, sweep: str | None) -> None:
    """Engine-shaped steps through ModelOps.attention: Triton-only vs the Mosaic/Triton split."""
    import numpy as np

    from jinfer.config.kernels import KernelPolicy
    from jinfer.models.batch import make_batch
    from jinfer.ops import ModelOps

    interpret = bool(KW.get("interpret"))
    n = 1024 if not interpret else 128
    steps = {  # name: [(new tokens, context incl. them)] (the runner's 8192-token budget)
        "8 x 1k prefill": [(n, n)] * 8,
        "64 decodes + 7.5 x 1k chunks": [(1, n + 100)] * 64 + [(n, n)] * 7 + [(n * 5 // 8, n * 5 // 8)],
    }
    if interpret:
        steps = {"smoke": [(1, 40), (n - 8, n)]}
    rng = np.random.default_rng(0)
    for name, seqs in steps.items():
        need = [-(-c // PAGE) for _, c in seqs]
        ids = (rng.permutation(sum(need)) + 1).tolist()
        pages = [ids[sum(need[:b]):sum(need[:b + 1])] for b in range(len(seqs))]
        unit = 128 if interpret else 1024  # the runner's token buckets
        num_tokens = -(-sum(q for q, _ in seqs) // unit) * unit
        batch = make_batch([([0] * q, c - q, pages[b]) for b, (q, c) in enumerate(seqs)], PAGE,
                           num_tokens=num_tokens)
        batch = jax.tree.map(jnp.asarray, batch)
        key = jax.random.key(len(seqs))
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (num_tokens, HEADS, DIM), DTYPE)
        k = jax.random.normal(kk, (sum(need) + 1, PAGE, KV_HEADS, DIM), DTYPE)
        v = jax.random.normal(kv, (sum(need) + 1, PAGE, KV_HEADS, DIM), DTYPE)
        flops = sum(4 * qn * (c - qn / 2) * HEADS * DIM for qn, c in seqs)
        shape = {"kernel": "mixed_step", "step": name, "tokens": num_tokens, "seqs": len(seqs), "flops": flops}
        for impl, ops in (("triton_only", ModelOps("pallas", interpret, mosaic_prefill=False)),
                          ("mosaic_long_triton_rest", ModelOps("pallas", interpret, mosaic_prefill=True))):
            entry = {**shape, "impl": impl}
            fn = jax.jit(lambda q, k, v, b, ops=ops: ops.attention(q, k, v, b, DIM**-0.5))
            dt = attempt(results, entry, fn, q, k, v, batch)
            if dt:
                entry["tflop_per_s"] = round(flops / dt / 1e12, 1)
        entry = {**shape, "impl": "mosaic_long_only", "min_query_len": KernelPolicy().mosaic_min_query_len}
        fn = functools.partial(ragged_prefill_attention_mgpu, min_query_len=KernelPolicy().mosaic_min_query_len, **KW)
        attempt(results, entry, fn, q, k, v, batch.query_start, batch.seq_lens, batch.page_table)


# ----------------------------------------------------------------------------------------------
def bench_route(results: list, sweep: str | None) -> None:
    """Decode-only steps at the runner's batch buckets: the paged decode kernel (default, and each
    fixed split count) against the ragged prefill kernel (what mixed steps use); the data behind
    the decode kernel's split policy and the runner's decode-only executables."""
    batches, contexts = SHAPES["route"]
    for batch in batches:
        for ctx in contexts:
            q, k, v, table, lens, kv_bytes = decode_inputs(batch, ctx)
            qs = jnp.arange(batch + 1, dtype=jnp.int32)
            shape = {"kernel": "decode_step", "batch": batch, "ctx": ctx, "kv_bytes": kv_bytes}
            runs = [("pallas_decode(default)", functools.partial(paged_decode_attention, **KW),
                     (q, k, v, table, lens), {})]
            runs += [("pallas_decode", functools.partial(paged_decode_attention, num_splits=s, **KW),
                      (q, k, v, table, lens), {"num_splits": s}) for s in (1, 2, 4)]
            runs.append(("pallas_prefill", functools.partial(ragged_prefill_attention, **KW),
                         (q, k, v, qs, lens, table), {}))
            for impl, fn, args, params in runs:
                entry = {**shape, "impl": impl, **params}
                dt = attempt(results, entry, fn, *args, wall=False)
                if dt:
                    entry["tb_per_s"] = round(kv_bytes / dt / 1e12, 3)
            del q, k, v


# ----------------------------------------------------------------------------------------------
def bench_mlp(results: list, sweep: str | None) -> None:
    (hidden, inter), token_counts = SHAPES["mlp"]
    key = jax.random.key(0)
    kx, kg, ku, kd = jax.random.split(key, 4)
    wg = jax.random.normal(kg, (hidden, inter), DTYPE) * hidden**-0.5
    wu = jax.random.normal(ku, (hidden, inter), DTYPE) * hidden**-0.5
    wd = jax.random.normal(kd, (inter, hidden), DTYPE) * inter**-0.5
    weight_bytes = 3 * hidden * inter * 2
    for tokens in token_counts:
        x = jax.random.normal(kx, (tokens, hidden), DTYPE)
        flops = 2 * tokens * hidden * inter * 3
        shape = {"kernel": "mlp", "tokens": tokens, "weight_bytes": weight_bytes, "flops": flops}

        def add(impl, fn, shape=shape, x=x, flops=flops, wall=True, **params):
            entry = {**shape, "impl": impl, **params}
            dt = attempt(results, entry, fn, x, wg, wu, wd, wall=wall)
            if dt:
                entry["weight_tb_per_s"] = round(weight_bytes / dt / 1e12, 3)
                entry["tflop_per_s"] = round(flops / dt / 1e12, 1)

        add("xla_reference", fused_swiglu_mlp_reference)
        add("pallas_mlp(default)", functools.partial(fused_swiglu_mlp, **KW))
        if sweep in ("all", "triton") and tokens <= 64:  # beyond that the partials traffic loses to XLA by construction
            for bi, warps, stages in ((32, 4, 3), (64, 4, 2), (64, 4, 4), (128, 4, 4), (128, 8, 3)):
                fn = functools.partial(fused_swiglu_mlp, block_i=bi, num_warps=warps, num_stages=stages, **KW)
                add("pallas_mlp", fn, block_i=bi, num_warps=warps, num_stages=stages, wall=False)


# ----------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="JSON path (default benchmarks/results/kernels_<gpu>.json)")
    parser.add_argument("--sweep", nargs="?", const="all", default=None, choices=("all", "triton", "mgpu"),
                        help="also time a grid of launch parameters (all kernels, or the Triton / Mosaic ones)")
    parser.add_argument("--only", default="decode,prefill,mixed,mlp",
                        help="comma list of decode,prefill,mixed,mlp,route (route: not in the default)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the selected benchmarks N times; the JSON's summary has each figure's median")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes in interpret mode (checks the script)")
    parser.add_argument("--attention-shape", default=None, metavar="H,KVH,D",
                        help="the attention kernels' heads, kv heads, head_dim (default 32,8,128: Qwen3-4B; "
                             "Qwen3.5-4B's full-attention layers are 16,4,256)")
    parser.add_argument("--decode-shapes", default=None, metavar="B:CTX,...",
                        help="the decode benchmark's (batch, context) pairs (default 1:8192,64:2048,256:1024)")
    args = parser.parse_args()
    global HEADS, KV_HEADS, DIM
    if args.attention_shape:
        HEADS, KV_HEADS, DIM = (int(x) for x in args.attention_shape.split(","))
    if args.decode_shapes:
        SHAPES["decode"] = tuple(tuple(int(x) for x in p.split(":")) for p in args.decode_shapes.split(","))
    warnings.simplefilter("ignore", DeprecationWarning)
    if args.smoke:
        SHAPES.update(SMOKE_SHAPES)
        KW["interpret"] = True
    elif jax.default_backend() != "gpu":
        sys.exit("bench_kernels.py needs a GPU (the kernels' CPU path is the interpreter); try --smoke")
    device = jax.devices()[0].device_kind
    commit = os.environ.get("JINFER_COMMIT")  # the device machine's copy of the tree has no .git
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent, check=True).stdout.strip()
    except Exception:
        commit = "unknown"
    meta = {"device": device, "jax_version": jax.__version__, "git_commit": commit,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "dtype": "bfloat16", "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "page_size": PAGE,
            "copy_bw_ceiling": COPY_BW, "matmul_peak": MATMUL_PEAK, "sweep": args.sweep,
            "timing": "time_us: device time per call from a jitted chain of 10 dependent calls, median of 5; "
                      "wall_us: per-call time of separate Python dispatches"}
    results: list = []
    out = Path(args.out or Path(__file__).parent / "results" / f"kernels_{device.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    benches = {"decode": bench_decode, "prefill": bench_prefill, "mixed": bench_mixed, "mlp": bench_mlp,
               "route": bench_route}
    summary: list = []
    for r in range(args.repeat):
        for name in args.only.split(","):
            first = len(results)
            try:
                benches[name](results, args.sweep)
            except Exception:
                results.append({"kernel": name, "error": traceback.format_exc()[-2000:]})
                print(results[-1]["error"], flush=True)
            if args.repeat > 1:
                for entry in results[first:]:
                    entry["repeat"] = r
                summary = summarize(results)
            out.write_text(json.dumps({"meta": meta, "summary": summary, "results": results}, indent=1))
    for row in summary:
        print(json.dumps(row))
    print(f"wrote {out}")


MEASURED = ("time_us", "wall_us", "tb_per_s", "tflop_per_s", "frac_copy_bw", "repeat")


def summarize(results: list) -> list:
    """Per measured configuration (same kernel, shape, impl and parameters): the median, min and max
    of its device time over the repeats, and its throughput at the median time."""
    groups: dict = {}
    for entry in results:
        if "time_us" not in entry:
            continue
        key = json.dumps({k: v for k, v in entry.items() if k not in MEASURED and not k.startswith("max_abs_err")},
                         sort_keys=True)
        groups.setdefault(key, []).append(entry)
    rows = []
    for key, entries in groups.items():
        times = sorted(e["time_us"] for e in entries)
        median = statistics.median(times)
        row = {**json.loads(key), "runs": len(times), "time_us_median": round(median, 2),
               "time_us_min": times[0], "time_us_max": times[-1]}
        for metric in ("tb_per_s", "tflop_per_s"):  # throughput = work / time: rescale one run's figure
            if metric in entries[0]:
                row[f"{metric}_at_median"] = round(entries[0][metric] * entries[0]["time_us"] / median, 3)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
