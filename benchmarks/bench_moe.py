"""Mixture-of-experts kernels on the GPU at Qwen3-30B-A3B expert shapes (128 experts, top-8, hidden
2048, moe_intermediate 768, bf16), with the peers measured in the same run:

- ours: routing kernel + grouped GEMMs (`pallas_kernels/moe/moe_routing.py`, `moe_gemm.py`: gate|up with
  the SwiGLU epilogue, down with the weighted scatter back to token order, then the k-sum), and the
  Mosaic GPU grouped GEMM (`moe_gemm_mgpu.py`) where it is present, on expert-sorted rows;
- `jax.lax.ragged_dot` (XLA) on the same expert-sorted rows;
- torch `_grouped_mm` (CUTLASS) in a subprocess (torch never shares the process with JAX): the two
  grouped matmuls (gate|up fused, then down) plus SwiGLU between them, captured in a CUDA graph,
  and torch's device copy bandwidth (the roofline's rate).

"gemm" figures time the two grouped matmuls with the routing given (what torch._grouped_mm is given);
"block" figures time the whole MoE MLP from router logits (routing included); "front" figures (`--front`,
steps of <= 64 tokens) time the block's front end from its input x to the routing: XLA's norm + router dot +
the routing kernel (at 1 / 2 / 4 warps), against the `moe_norm_route` kernel (all three in one; 1 / 2 / 4 warps,
its default K splits, 1 and 8); bandwidth there counts the router's bytes. Our times are the sum of
the call's kernel times from CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`, median of 20 calls,
split by kernel); torch's are CUDA-event times of a CUDA graph of 10 chained calls (gaps between its
kernels included, a few us).
Bandwidth counts the bytes of the experts actually hit; TFLOP/s the real routed rows (2 x rows x 3 x H x I).
`--fp8` ("fp8" rows, default 1 / 8 / 16 / 4096 tokens): the Triton grouped GEMMs on block-FP8 experts (128 x 128
scales; [E, out, in] as the engine keeps them, and [E, in, out]) against the same kernels on the bf16 experts (same
routing), and the Mosaic GPU grouped GEMMs (bf16, and e4m3: moe_fp8_mgpu.py) where a step reaches them; FP8 bandwidth
counts its bytes (values and scales). "tflop_per_s" counts the routed rows' FLOPs (not the padding's).

    python -m benchmarks.bench_moe --out benchmarks/results/moe_kernels_h100.json [--sweep] [--tokens 1 8 64]
    python -m benchmarks.bench_moe --fp8 --out benchmarks/results/moe_fp8_h200.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import signal
import statistics
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.bench_kernels import chained, timeit
from benchmarks.common import environment, write_result
from jinfer.models.fp8 import quantize, transpose
from jinfer.models.layers import moe_mlp, rms_norm
from jinfer.ops import ModelOps
from jinfer.ops.moe import moe_block_m
from pallas_kernels.moe.moe_gemm import moe_combine, moe_down, moe_gate_up
from pallas_kernels.moe.moe_router import MAX_TOKENS as ROUTER_MAX_TOKENS
from pallas_kernels.moe.moe_router import moe_norm_route
from pallas_kernels.moe.moe_routing import moe_route, moe_route_reference

E, H, INTER, K = 128, 2048, 768, 8
TOKENS = (1, 8, 64, 512, 4096)
FP8_TOKENS = (1, 8, 16, 4096)
FP8_BLOCK = (128, 128)
DTYPE = jnp.bfloat16
KW: dict = {}  # {"interpret": True} under --smoke (CPU check of the script at tiny shapes)
SKIP: set = set()  # --skip ragged: no ragged_dot / whole-block rows (each row is a compile: ~20 s on the H100)


def weights(seed: int = 0):
    kg, ku, kd, kr = jax.random.split(jax.random.key(seed), 4)
    w = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(DTYPE)  # noqa: E731
    return w(kg, (E, H, INTER)), w(ku, (E, H, INTER)), w(kd, (E, INTER, H)), w(kr, (H, E))


def cupti_split(fn, *args, iterations: int = 20) -> dict | None:
    """Median per-kernel device time (us) of one call of fn, by kernel name, from CUPTI."""
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, runs = profiler.measure(fn, aggregate=False, iterations=iterations)(*args)
    except Exception as e:  # CUPTI may be unavailable
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    if not runs:
        return None
    names = [n for n, _ in runs[0]]
    per = {n: [] for n in names}
    for run in runs:
        for n, ms in run:
            per.setdefault(n, []).append(ms * 1e3)
    split = {n: round(statistics.median(v), 2) for n, v in per.items()}
    split["total_us"] = round(sum(split.values()), 2)
    return split


def record(rows: list, entry: dict, fn, *args, hit_bytes: int, flops: float, split=True):
    """Device time of one call: the sum of its kernels' CUPTI times (one compile; a chain of 10 calls compiled
    each Triton kernel 10 times, minutes per row on the H100), else (CPU) a chain of calls."""
    try:
        cupti = cupti_split(jax.jit(fn), *args)
        if cupti and "total_us" in cupti:
            dt = cupti["total_us"] / 1e6
            entry["cupti_us"] = cupti
        else:
            dt = timeit(chained(fn), *args) / 10
        entry.update(time_us=round(dt * 1e6, 2), tb_per_s=round(hit_bytes / dt / 1e12, 3),
                     tflop_per_s=round(flops / dt / 1e12, 1))
    except Exception as e:
        entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
    rows.append(entry)
    print(json.dumps(entry), flush=True)


def sorted_rows(x, ids):
    """x's rows per (token, slot) pair sorted by expert, and the group sizes (ragged_dot / torch input)."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return x[order // K], jnp.bincount(flat, length=E).astype(jnp.int32)


SWEEP_GRID: dict[str, tuple[int, ...]] = {}  # --sweep-n / --sweep-k / --sweep-warps / --sweep-stages overrides


def sweep_configs(block_m: int) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, num_warps, num_stages) grid: weight-streaming tiles for decode-sized blocks,
    tensor-core tiles for prefill-sized ones; any axis replaced by SWEEP_GRID's. (At one token the gate|up
    kernel has experts x I / block_n programs: 96 at block_n 64 for 132 SMs, one partial wave; 16 gives 384.)"""
    if block_m <= 16:
        grid = {"n": (32, 64, 128), "k": (128, 256), "warps": (4, 8), "stages": (3, 5)}
    else:
        grid = {"n": (64, 128, 256), "k": (32, 64), "warps": (4, 8), "stages": (3, 4)}
    grid |= SWEEP_GRID
    return [(n, k, wp, st) for n in grid["n"] for k in grid["k"] for wp in grid["warps"] for st in grid["stages"]]


def bench_tokens(rows: list, tokens: int, w, sweep: bool, xla_block: bool) -> None:
    wg, wu, wd, router = w
    kx, kl = jax.random.split(jax.random.key(tokens))
    x = jax.random.normal(kx, (tokens, H), DTYPE)
    logits = (x @ router).astype(DTYPE)
    bm = moe_block_m(tokens * K, E)
    routing = moe_route(logits, top_k=K, block_m=bm, **KW)
    hit = int(np.unique(np.asarray(routing.topk_ids)).size)
    hit_bytes = hit * 3 * H * INTER * 2
    flops = 2 * tokens * K * 3 * H * INTER
    base = {"tokens": tokens, "top_k": K, "experts_hit": hit, "hit_bytes": hit_bytes, "flops": flops}

    # correctness of the whole block against the XLA reference (bf16)
    ref = moe_mlp(x, logits, wg, wu, wd, K, True)
    ours = moe_combine(moe_down(moe_gate_up(x, routing, wg, wu, **KW), routing, wd, **KW), K, DTYPE)
    base["max_abs_err_vs_ref"] = float(jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32)).max())
    base["ref_max_abs"] = float(jnp.abs(ref.astype(jnp.float32)).max())

    def gemm(x, routing=routing, **kw):
        kw = {**KW, **kw}
        return moe_combine(moe_down(moe_gate_up(x, routing, wg, wu, **kw), routing, wd, **kw), K, x.dtype)

    record(rows, {**base, "what": "gemm", "impl": "pallas_triton", "block_m": bm}, gemm, x, hit_bytes=hit_bytes,
           flops=flops)
    if sweep:  # per-kernel CUPTI times of each configuration (gate|up and down tuned independently)
        for n, k, wp, st in sweep_configs(bm):
            fn = jax.jit(functools.partial(gemm, block_n=n, block_k=k, num_warps=wp, num_stages=st))
            entry = {**base, "what": "sweep", "impl": "pallas_triton", "block_m": bm, "block_n": n, "block_k": k,
                     "num_warps": wp, "num_stages": st, "cupti_us": cupti_split(fn, x)}
            rows.append(entry)
            print(json.dumps(entry), flush=True)
        for bm2 in (16, 32, 64, 128):
            if bm2 == bm or tokens * K < 4 * bm2:
                continue
            r2 = moe_route(logits, top_k=K, block_m=bm2, **KW)
            record(rows, {**base, "what": "gemm", "impl": "pallas_triton", "block_m": bm2},
                   functools.partial(gemm, routing=r2), x, hit_bytes=hit_bytes, flops=flops, split=False)

    try:
        from pallas_kernels.moe import moe_gemm_mgpu
    except ImportError:
        moe_gemm_mgpu = None
    if moe_gemm_mgpu is not None and tokens * K >= 512:
        for mbm in ((64, 128) if sweep else (128,)):
            r = moe_route_reference(logits, top_k=K, block_m=mbm)

            def mgpu(x, r=r):
                return moe_gemm_mgpu.moe_experts_mgpu(x, r, wg, wu, wd, **KW)

            try:
                err = float(jnp.abs(mgpu(x).astype(jnp.float32) - ref.astype(jnp.float32)).max())
            except Exception as e:
                err = f"{type(e).__name__}: {str(e)[:200]}"
            record(rows, {**base, "what": "gemm", "impl": "pallas_mgpu", "block_m": mbm, "max_abs_err_vs_ref": err},
                   mgpu, x, hit_bytes=hit_bytes, flops=flops)

    xs, sizes = sorted_rows(x, routing.topk_ids)

    def ragged(xs):
        g = jax.lax.ragged_dot(xs, wg, sizes, preferred_element_type=jnp.float32)
        u = jax.lax.ragged_dot(xs, wu, sizes, preferred_element_type=jnp.float32)
        h = (jax.nn.silu(g) * u).astype(xs.dtype)
        return jax.lax.ragged_dot(h, wd, sizes, preferred_element_type=jnp.float32).astype(xs.dtype)

    if "ragged" in SKIP:
        return
    record(rows, {**base, "what": "gemm", "impl": "xla_ragged_dot"}, ragged, xs, hit_bytes=hit_bytes, flops=flops)

    # the whole MoE MLP from the normed input: router, routing, experts, combine (+ residual)
    norm = jnp.ones((H,), DTYPE)
    impls = [("pallas", ModelOps("pallas", interpret=bool(KW), mosaic_prefill=not KW))]
    if xla_block:  # (slow to compile on the H100: XLA autotunes the ragged_dot fusions of the chain)
        impls.append(("xla_reference", ModelOps()))
    for name, ops in impls:
        def block(x, ops=ops):  # with the step's counters, as the model runs it (small steps: one front-end kernel)
            return ops.moe_block(x, norm, router, wg, wu, wd, top_k=K, renormalize=True, eps=1e-6,
                                 counters=ops.step_counters(x.shape[0]))[0]

        record(rows, {**base, "what": "block", "impl": name}, block, x, hit_bytes=hit_bytes, flops=flops)


def bench_fp8(rows: list, tokens: int, w, q) -> None:
    """--fp8: the grouped GEMMs with the block-FP8 experts q (Fp8Weight gate, up, down) against the bf16 ones w, one
    routing; the FP8 result's error against `layers.moe_mlp` on q dequantized (XLA)."""
    wg, wu, wd, router = w
    x = jax.random.normal(jax.random.key(tokens), (tokens, H), DTYPE)
    logits = (x @ router).astype(DTYPE)
    bm = moe_block_m(tokens * K, E)
    routing = moe_route(logits, top_k=K, block_m=bm, **KW)
    hit = int(np.unique(np.asarray(routing.topk_ids)).size)
    per_expert, flops = 3 * H * INTER, 2 * tokens * K * 3 * H * INTER
    scale_bytes = sum(s.scale.nbytes for s in q) // E  # one expert's
    base = {"what": "fp8", "tokens": tokens, "top_k": K, "experts_hit": hit, "flops": flops, "block_m": bm}
    fp8_kw = {"scale_block": FP8_BLOCK, **KW}

    # [E, out, in]: the engine's layout (fp8.kernel_layout); transpose donates its input on a GPU: a copy's
    qt = [transpose(dataclasses.replace(a, w=jnp.array(a.w, copy=True))) for a in q]

    def triton(x, experts=None):
        if experts is None:
            return moe_combine(moe_down(moe_gate_up(x, routing, wg, wu, **KW), routing, wd, **KW), K, x.dtype)
        h = moe_gate_up(x, routing, experts[0].w, experts[1].w, (experts[0].scale, experts[1].scale), **fp8_kw)
        return moe_combine(moe_down(h, routing, experts[2].w, experts[2].scale, **fp8_kw), K, x.dtype)

    ref = moe_mlp(x, logits, *q, K, True).astype(jnp.float32)
    record(rows, {**base, "impl": "pallas_triton_bf16"}, triton, x, hit_bytes=hit * per_expert * 2, flops=flops)
    # (the [E, in, out] layout was slower: 40.2 / 234.6 vs 28.5 / 137.2 us at 1 / 16 tokens, moe_fp8_layouts_h200.json)
    err = float(jnp.abs(triton(x, qt).astype(jnp.float32) - ref).max())
    record(rows, {**base, "impl": "pallas_triton_fp8", "max_abs_err_vs_ref": err,
                  "ref_max_abs": float(jnp.abs(ref).max())},
           functools.partial(triton, experts=qt), x, hit_bytes=hit * (per_expert + scale_bytes), flops=flops)
    if tokens * K >= 512 and not KW:  # the Mosaic GPU grouped GEMMs, where large steps run: bf16 and e4m3
        from pallas_kernels.moe.moe_fp8_mgpu import moe_experts_fp8_mgpu
        from pallas_kernels.moe.moe_gemm_mgpu import moe_experts_mgpu

        r = moe_route_reference(logits, top_k=K, block_m=128)
        record(rows, {**base, "impl": "pallas_mgpu_bf16", "block_m": 128},
               lambda x: moe_experts_mgpu(x, r, wg, wu, wd), x, hit_bytes=hit * per_expert * 2, flops=flops)
        vals, scales = tuple(a.w for a in qt), tuple(a.scale for a in qt)
        err = float(jnp.abs(moe_experts_fp8_mgpu(x, r, *vals, scales).astype(jnp.float32) - ref).max())
        record(rows, {**base, "impl": "pallas_mgpu_fp8", "block_m": 128, "max_abs_err_vs_ref": err},
               lambda x: moe_experts_fp8_mgpu(x, r, *vals, scales), x, hit_bytes=hit * (per_expert + scale_bytes),
               flops=flops)


def bench_front(rows: list, tokens: int, router) -> None:
    """The MoE block's front end, x -> (h, routing): XLA's norm and router dot then the routing kernel, or the
    moe_norm_route kernel; CUPTI kernel times per variant."""
    x = (3 * jax.random.normal(jax.random.key(tokens + 7), (tokens, H))).astype(DTYPE)
    norm = jnp.ones((H,), DTYPE)
    bm = moe_block_m(tokens * K, E)
    base = {"what": "front", "tokens": tokens, "hit_bytes": H * E * 2, "flops": 2 * tokens * H * E}

    def xla(x, warps=None):
        h = rms_norm(x, norm, 1e-6)
        logits = ModelOps().project(h, router, preferred_element_type=jnp.float32).astype(h.dtype)
        return h, moe_route(logits, top_k=K, block_m=bm, num_warps=warps, **KW)

    def kernel(x, warps=None, k_splits=None):
        h, routing, _ = moe_norm_route(x, norm, router, jnp.zeros((16,), jnp.int32), top_k=K, renormalize=True,
                                       block_m=bm, eps=1e-6, num_warps=warps, k_splits=k_splits, **KW)
        return h, routing

    ref_ids = np.asarray(xla(x)[1].topk_ids)
    variants = [("xla", {"warps": w}) for w in (None, 1, 2, 4)]
    variants += [("front_kernel", {"warps": w, "k_splits": s}) for w, s in
                 ((None, None), (1, None), (2, None), (None, 1), (None, 8)) if s is None or H % (s * 16) == 0]
    for impl, kw in variants:
        fn = functools.partial(xla if impl == "xla" else kernel, **kw)
        entry = {**base, "impl": impl, **{k: v for k, v in kw.items() if v is not None}}
        try:
            entry["same_experts_as_xla"] = bool((np.asarray(fn(x)[1].topk_ids) == ref_ids).all())
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(entry)
            print(json.dumps(entry), flush=True)
            continue
        record(rows, entry, chainable(fn) if KW else fn, x, hit_bytes=base["hit_bytes"], flops=base["flops"])


def chainable(front):
    """x -> an x-shaped output that keeps the routing alive: the CPU smoke check times a chain of calls."""
    def fn(x):
        h, routing = front(x)
        return h + 0 * routing.topk_weights[:, :1].astype(h.dtype)
    return fn


# ----------------------------------------------------------------------------------------------
# torch peer (subprocess)
# ----------------------------------------------------------------------------------------------
def torch_peer(tokens_list) -> list[dict]:
    import torch

    dev = "cuda"
    torch.manual_seed(0)
    w13 = (torch.randn(E, 2 * INTER, H, device=dev) * 0.02).to(torch.bfloat16)  # [E, out, in] like HF
    w2 = (torch.randn(E, H, INTER, device=dev) * 0.02).to(torch.bfloat16)
    out = []
    nbytes = 1 << 31
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        ev0.record()
        b.copy_(a)
        ev1.record()
        torch.cuda.synchronize()
        best = min(best, ev0.elapsed_time(ev1) / 1e3)
    out.append({"impl": "torch_copy", "copy_bytes_per_s": 2 * nbytes / best, "torch_version": torch.__version__})
    del a, b
    for tokens in tokens_list:
        ids = torch.rand(tokens, E, device=dev).argsort(dim=1)[:, :K]  # K distinct experts per token, uniform
        counts = torch.bincount(ids.flatten(), minlength=E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x = torch.randn(tokens * K, H, device=dev).to(torch.bfloat16)  # already expert-sorted rows
        hit = int((counts > 0).sum())
        hit_bytes = hit * 3 * H * INTER * 2
        flops = 2 * tokens * K * 3 * H * INTER

        def step(x, offs=offs):
            gu = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)  # [R, 2I]
            g, u = gu.chunk(2, dim=-1)
            h = torch.nn.functional.silu(g) * u
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)  # [R, H]

        entry = {"what": "gemm", "impl": "torch_grouped_mm", "tokens": tokens, "experts_hit": hit,
                 "hit_bytes": hit_bytes, "flops": flops}
        try:
            for _ in range(3):
                step(x)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = x
                for _ in range(10):
                    y = step(y)
            times = []
            for _ in range(5):
                g.replay()
                torch.cuda.synchronize()
                ev0.record()
                g.replay()
                ev1.record()
                torch.cuda.synchronize()
                times.append(ev0.elapsed_time(ev1) / 1e3 / 10)
            dt = statistics.median(times)
            entry.update(time_us=round(dt * 1e6, 2), tb_per_s=round(hit_bytes / dt / 1e12, 3),
                         tflop_per_s=round(flops / dt / 1e12, 1))
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(entry)
    return out


def run_torch_peer(tokens_list) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.bench_moe", "--torch-peer", "--tokens", *map(str, tokens_list)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return [{"impl": "torch_grouped_mm", "error": "timeout"}]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode:
        rows.append({"impl": "torch_grouped_mm", "error": proc.stderr[-500:]})
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", help=f"default {TOKENS} (--fp8: {FP8_TOKENS})")
    ap.add_argument("--sweep", action="store_true", help="also time a grid of Triton tile / launch parameters")
    ap.add_argument("--sweep-tokens", type=int, nargs="*", help="token counts the sweep runs at (default: all)")
    for axis in ("n", "k", "warps", "stages"):
        ap.add_argument(f"--sweep-{axis}", type=int, nargs="+", help=f"the sweep's {axis} values (default: by block_m)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--skip", nargs="*", default=[], choices=["ragged"])
    ap.add_argument("--xla-block", action="store_true", help="also time the whole MoE block through XLA (ragged_dot)")
    ap.add_argument("--front", action="store_true", help="also time the block's front end (norm + router + routing)")
    ap.add_argument("--front-only", action="store_true", help="only the front-end rows (no torch peer, no GEMMs)")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 experts vs bf16 on the grouped GEMMs only")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, kernels interpreted (CPU check)")
    ap.add_argument("--torch-peer", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    args = ap.parse_args()
    args.tokens = args.tokens or list(FP8_TOKENS if args.fp8 else TOKENS)
    if args.torch_peer:
        for row in torch_peer(args.tokens):
            print(json.dumps(row), flush=True)
        return
    SKIP.update(args.skip)
    SWEEP_GRID.update({axis: tuple(v) for axis in ("n", "k", "warps", "stages")
                       if (v := getattr(args, f"sweep_{axis}")) is not None})
    if args.smoke:
        global E, H, INTER, K
        E, H, INTER, K = 8, 64, 32, 2
        KW["interpret"] = True
        args.tokens, args.no_torch = [1, 16] if args.fp8 else [1, 64], True
    peer = [] if args.no_torch or args.front_only or args.fp8 else run_torch_peer(args.tokens)
    w = weights()
    q = [quantize(a.astype(jnp.float32), FP8_BLOCK) for a in w[:3]] if args.fp8 else None
    rows: list[dict] = []
    # A run ended by `timeout` (SIGTERM) still writes the rows it has, marked incomplete (the handler runs once
    # the call in progress, e.g. a compile, returns).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    complete = False
    try:
        for tokens in args.tokens:
            if (args.front or args.front_only) and tokens <= ROUTER_MAX_TOKENS:
                bench_front(rows, tokens, w[3])
            if args.front_only:
                continue
            if args.fp8:
                bench_fp8(rows, tokens, w, q)
                continue
            sweep = args.sweep and (not args.sweep_tokens or tokens in args.sweep_tokens)
            bench_tokens(rows, tokens, w, sweep, args.xla_block)
        complete = True
    finally:
        copy = next((r["copy_bytes_per_s"] for r in peer if r.get("impl") == "torch_copy"), None)
        write_result({"benchmark": "moe_kernels", **environment(), "experts": E, "hidden": H,
                      "moe_intermediate": INTER, "top_k": K, "dtype": "bfloat16",
                      "fp8_block": list(FP8_BLOCK) if args.fp8 else None, "torch_copy_bytes_per_s": copy,
                      "complete": complete, "rows": rows + peer}, args.out)


if __name__ == "__main__":
    main()
