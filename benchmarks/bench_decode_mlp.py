"""The decode step's MLP as the forward runs it: a chain of `--layers` residual MLP blocks (RMSNorm, SwiGLU,
residual add) over distinct weights in one executable, one token (or `--tokens`) per step, so each layer's
weights come from HBM and no dispatch is timed. The fused Pallas kernel (`pallas_kernels/dense/fused_mlp.py`: its
norm prologue variants, over a grid of launch parameters) against XLA's fusion of the same block. TB/s on the
weight bytes; the copy rate of the same run (`roofline.measure_copy_bandwidth`) for the ratio. The chain runs
without a CUDA graph, so its wall time carries launch gaps; `--profile` adds each config's GPU kernel time.

    python -m benchmarks.bench_decode_mlp --shapes qwen3.5-4b qwen3-4b --out benchmarks/results/decode_mlp_h100.json
    python -m benchmarks.bench_decode_mlp --shapes qwen3-8b --fp8 --tokens 1 8 --block-i 64 128 --num-warps 4 8 \
        --num-stages 3 4 --variants fused fused_1tile --profile /tmp/mlp --out decode_mlp_fp8_h200.json

`--fp8`: block-FP8 weights (128 x 128 scales, [out, in] in the kernel as the engine keeps them, e4m3 activations;
XLA's side dequantizes them to bf16 first, as the jnp path does); TB/s on the FP8 bytes and their scales. The variant
`fused_1tile` takes one K tile a loop step (`fused`: two, as the engine does at these shapes).

On CPU (no GPU): tiny shapes through the Pallas interpreter, to check the script.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_result
from jinfer.models.layers import rms_norm, swiglu_mlp
from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp

SHAPES = {"qwen3.5-4b": (2560, 9216), "qwen3-4b": (2560, 9728), "qwen3-8b": (4096, 12288), "tiny": (64, 256),
          # MoE layers' shared experts (one SwiGLU of their total width)
          "deepseek-v2-lite-shared": (2048, 2816), "qwen3.5-35b-a3b-shared": (2048, 512)}
EPS = 1e-6


FP8_BLOCK = (128, 128)


def chain(mlp, layers: int):
    """x -> x + mlp(x) over `layers` weight sets ((norm, gate, up, down, FP8 scales or None) each), unrolled in one
    executable."""
    def run(x, weights):
        for norm, wg, wu, wd, scales in weights:
            x = x + mlp(x, norm, wg, wu, wd, scales)
        return x
    return jax.jit(run)


def _xla(x, norm, wg, wu, wd, scales):
    if scales is not None:  # the jnp path's FP8: each weight dequantized to the activations' dtype, then XLA's dots
        from pallas_kernels.dense.fp8_tiles import dequantize

        wg, wu, wd = (dequantize(w, s, FP8_BLOCK).astype(x.dtype) for w, s in zip((wg, wu, wd), scales, strict=True))
    return swiglu_mlp(rms_norm(x, norm, EPS), wg, wu, wd)


def timed(fn, x, weights, reps: int) -> float:
    """Median seconds of `reps` calls (each synced)."""
    jax.block_until_ready(fn(x, weights))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x, weights))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def kernel_times(fn, x, weights, reps: int, trace_dir: str) -> dict:
    """GPU kernel time per call by kernel name (us), from a profile of `reps` calls: what the chain's kernels
    take without the launch gaps between them (the forward runs them in a CUDA graph)."""
    from benchmarks.trace_summary import gpu_kernel_times

    with jax.profiler.trace(trace_dir):
        for _ in range(reps):
            jax.block_until_ready(fn(x, weights))
    return gpu_kernel_times(trace_dir, reps)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen3.5-4b", "qwen3-4b"], choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--block-i", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--num-stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", nargs="+", default=["fused", "fused_loop_norm", "prenorm"],
                    help="fused: the kernel with its norm (the sum of squares unrolled); fused_loop_norm: the sum of "
                         "squares as a loop; prenorm: XLA's norm, then the kernel without one; fused_1tile (--fp8): "
                         "fused with one K tile a loop step")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 weights (128 x 128 blocks)")
    ap.add_argument("--profile", metavar="DIR", help="also the GPU kernel time per layer, from a profile per config")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    if not gpu:
        args.shapes, args.layers, args.reps = ["tiny"], 2, 1
        args.block_i, args.num_warps, args.num_stages = [32], [4], [2]
        if args.fp8:
            SHAPES["tiny"] = (256, 512)  # (whole 128 x 128 scale blocks)
    copy = {}
    if gpu:
        from benchmarks.roofline import measure_copy_bandwidth

        copy = measure_copy_bandwidth()
    copy_bps = copy.get("best_Bps", 0)
    rows = []
    key = jax.random.key(0)
    for shape in args.shapes:
        hidden, inter = SHAPES[shape]
        weights = []
        for layer in range(args.layers):
            kg, ku, kd = jax.random.split(jax.random.fold_in(key, layer), 3)
            weights.append((jnp.ones((hidden,), jnp.bfloat16),
                            (jax.random.normal(kg, (hidden, inter)) * hidden**-0.5).astype(jnp.bfloat16),
                            (jax.random.normal(ku, (hidden, inter)) * hidden**-0.5).astype(jnp.bfloat16),
                            (jax.random.normal(kd, (inter, hidden)) * inter**-0.5).astype(jnp.bfloat16)))
        layer_bytes = 3 * hidden * inter * 2
        scales = [None] * args.layers
        if args.fp8:
            from jinfer.models.fp8 import quantize

            qs = [[quantize(w.astype(jnp.float32), FP8_BLOCK) for w in ws[1:]] for ws in weights]
            weights = [(ws[0], *(q.w for q in q3)) for ws, q3 in zip(weights, qs, strict=True)]
            scales = [tuple(q.scale for q in q3) for q3 in qs]
            layer_bytes = sum(q.w.nbytes + q.scale.nbytes for q in qs[0])
        weights = [(*ws, s_) for ws, s_ in zip(weights, scales, strict=True)]
        # (the kernel reads FP8 weights [out, in]: copies made once, a transpose in the chain would be timed)
        swapped = [(n, *(jnp.asarray(w.T) for w in (wg, wu, wd)), s_) for n, wg, wu, wd, s_ in weights] \
            if args.fp8 else weights
        for tokens in args.tokens:
            x = jax.random.normal(jax.random.key(1), (tokens, hidden)).astype(jnp.bfloat16)
            configs = [("xla", None)] + [(v, c) for v in args.variants
                                         for c in itertools.product(args.block_i, args.num_warps, args.num_stages)]
            for impl, cfg in configs:
                if impl == "xla":
                    mlp = _xla
                    params = {}
                else:
                    bi, warps, stages = cfg
                    if inter % bi:
                        continue
                    params = {"block_i": bi, "num_warps": warps, "num_stages": stages}
                    mlp = functools.partial(_pallas, interpret=not gpu, variant=impl, **params)
                ws = weights if impl == "xla" else swapped
                try:
                    fn = chain(mlp, args.layers)
                    t = timed(fn, x, ws, args.reps) / args.layers
                except Exception as e:  # a launch configuration that does not fit (shared memory): recorded
                    rows.append({"shape": shape, "tokens": tokens, "impl": impl, **params, "error": str(e)[:200]})
                    print(rows[-1], flush=True)
                    continue
                row = {"shape": shape, "tokens": tokens, "impl": impl, **params, "us_per_layer": round(t * 1e6, 2),
                       "weight_tb_per_s": round(layer_bytes / t / 1e12, 3)}
                if args.profile:
                    name = "_".join([shape, str(tokens), impl] + [str(v) for v in params.values()])
                    k = kernel_times(fn, x, ws, 5, f"{args.profile}/{name}")
                    kt = sum(k.values()) / args.layers
                    row["kernel_us_per_layer"] = round(kt, 2)
                    if kt:  # (no device kernels in a CPU trace)
                        row["kernel_tb_per_s"] = round(layer_bytes / (kt * 1e-6) / 1e12, 3)
                    row["kernels_us_per_layer"] = {n: round(v / args.layers, 2) for n, v in
                                                   sorted(k.items(), key=lambda kv: -kv[1])[:4]}
                if copy_bps:
                    row["fraction_of_copy_rate"] = round(layer_bytes / t / copy_bps, 3)
                rows.append(row)
                print(row, flush=True)
    write_result({"benchmark": "decode_mlp", **environment(), "copy": copy, "layers": args.layers,
                  "results": rows}, args.out)


def _pallas(x, norm, wg, wu, wd, scales, *, variant, block_i, num_warps, num_stages, interpret):
    kw = dict(block_i=block_i, num_warps=num_warps, num_stages=num_stages, interpret=interpret, scales=scales,
              scale_block=scales and FP8_BLOCK)
    if variant == "prenorm":
        return fused_swiglu_mlp(rms_norm(x, norm, EPS), wg, wu, wd, **kw)
    if scales is not None:
        kw["tiles_per_step"] = 1 if variant == "fused_1tile" else 2
    return fused_swiglu_mlp(x, wg, wu, wd, norm, eps=EPS, unroll_norm=variant != "fused_loop_norm", **kw)


if __name__ == "__main__":
    main()
