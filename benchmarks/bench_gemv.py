"""Decode-sized projections (one token) as GPU kernel time: XLA's GEMM, the Triton skinny GEMM, and the Mosaic GPU
(TMA + wgmma) grouped GEMM used as a plain GEMM (one expert, the token padded to a 64-row tile).

    python -m benchmarks.bench_gemv --out benchmarks/results/gemv_h100.json

The question it answers: does a TMA-fed kernel stream more bytes per SM than the Triton loops (~37 GB/s per SM on
the H100, so 48 programs ~1.8 TB/s)? Each shape runs as a chain of `--weights` distinct weight matrices in one
executable (each read from HBM, not L2), and the time is the kernels' GPU time from a profile, per matrix, so
launch gaps do not count. TB/s on the weight bytes; the copy rate of the same run for scale.

On CPU (no GPU): tiny shapes through the interpreters, to check the script.
"""

from __future__ import annotations

import argparse
import functools
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.common import environment, write_result

# name: (K, N) of Qwen3-4B's decode projections
SHAPES = {"qkv": (2560, 6144), "o": (4096, 2560), "gate": (2560, 9728), "down": (9728, 2560)}


def kernel_us(fn, args, reps: int) -> dict[str, float]:
    """GPU kernel time per call by kernel name (us), from a profile of `reps` calls."""
    from benchmarks.trace_summary import gpu_kernel_times

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(reps):
                jax.block_until_ready(fn(*args))
        return gpu_kernel_times(d, reps)[0]


def impls(interpret: bool):
    from pallas_kernels.dense.skinny_gemm import skinny_gemm
    from pallas_kernels.moe.moe_gemm_mgpu import moe_grouped_matmul_mgpu

    def xla(x, w):
        return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w)[:1]  # ops.project's padded row: a GEMM, not a reduce

    def triton(x, w):
        return skinny_gemm(x, w, interpret=interpret)

    def mosaic(x, w, *, block_n, block_k, max_steps):
        x64 = jnp.pad(x, ((0, 63), (0, 0)))  # one 64-row tile
        return moe_grouped_matmul_mgpu(x64, w[None], jnp.zeros((1,), jnp.int32), block_m=64, block_n=block_n,
                                       block_k=block_k, max_steps=max_steps, wg_split="n", interpret=interpret)[:1]

    out = {"xla": xla, "triton_skinny": triton}
    for bn, bk, steps in ((128, 64, 6), (128, 128, 4), (256, 64, 4)):
        out[f"mosaic_n{bn}_k{bk}_s{steps}"] = functools.partial(mosaic, block_n=bn, block_k=bk, max_steps=steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=sorted(SHAPES))
    ap.add_argument("--weights", type=int, default=8, help="distinct weight matrices per chain (HBM, not L2)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    rows = []
    copy = None
    if gpu:
        from benchmarks.roofline import measure_copy_bandwidth

        copy = measure_copy_bandwidth()
    for name in args.shapes:
        k, n = SHAPES[name] if gpu else (256, 256)
        keys = jax.random.split(jax.random.key(0), args.weights + 1)
        x = jax.random.normal(keys[0], (1, k), jnp.bfloat16)
        ws = [jax.random.normal(kk, (k, n), jnp.bfloat16) * k**-0.5 for kk in keys[1:]]
        for impl, f in impls(not gpu).items():
            chain = jax.jit(lambda x, ws, f=f: [f(x, w) for w in ws])
            try:
                ref = jnp.dot(x.astype(jnp.float32), ws[0].astype(jnp.float32))
                got = chain(x, ws)[0].astype(jnp.float32)
                err = float(jnp.max(jnp.abs(got - ref)) / (jnp.max(jnp.abs(ref)) + 1e-6))
                per = kernel_us(chain, (x, ws), args.reps if gpu else 1)
            except Exception as e:  # noqa: BLE001 - a config the kernel refuses is a row, not a crash
                rows.append({"shape": name, "K": k, "N": n, "impl": impl, "error": f"{type(e).__name__}: {e}"[:300]})
                print(rows[-1], flush=True)
                continue
            us = sum(per.values()) / args.weights
            rate = k * n * 2 / us / 1e6 if us else None
            row = {"shape": name, "K": k, "N": n, "impl": impl, "us": us, "tb_per_s": rate,
                   "max_rel_err": err, "kernels_us": {kk: v / args.weights for kk, v in per.items()}}
            rows.append(row)
            print({kk: (round(v, 3) if isinstance(v, float) else v) for kk, v in row.items() if kk != "kernels_us"},
                  flush=True)
    write_result({"benchmark": "gemv", **environment(), "copy_bandwidth": copy, "weights_per_chain": args.weights,
                  "rows": rows}, args.out)


if __name__ == "__main__":
    main()
