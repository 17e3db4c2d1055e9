"""Decode step time of the sharded forward at 1 and N devices, in one process, and what its collectives cost.

    python -m benchmarks.bench_parallel --shape qwen3-8b --tp 1 2 --batch-sizes 1 16 --variants psum one_shot

For each mesh size, the model's weights are placed as the engine places them (`load_weights` +
`shard_attention_weights`) and the engine's decode-step forward (`parallel.mesh_forward`, the decode
kernels) is compiled once per variant of its reductions (`VARIANTS`); steps are dispatched back to
back with their inputs on the device and synced once (time per step, the host's launch included). Each
sequence has `--context` tokens of context. Per variant it also times the step's reduction alone: of
[batch, hidden] in the activation dtype, 200 in a row inside one executable.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from benchmarks.common import add_profile_argument, environment, profiled, write_result
from jinfer.cache.layout import init_kv_cache
from jinfer.config.kernels import KernelPolicy
from jinfer.models.batch import make_batch
from jinfer.models.registry import forward, shard_weights
from jinfer.ops import select_ops
from jinfer.parallel.mesh import TP_AXIS, all_reduce_table, array_specs, check_parallel, make_mesh, mesh_forward
from jinfer.weights.loader import DTYPES, load_weights, resolve_model
from pallas_kernels import all_reduce

# How the step reduces its partial sums and gathers its logits: XLA's collectives (NCCL), or our one-shot kernels over
# peer memory (pallas_kernels/all_reduce.py, the engine's choice up to KernelPolicy.one_shot_all_*_bytes). XLA's own
# options for its collectives (one-shot kernels, collectives in command buffers, the smallest command buffer) were
# measured no faster (docs/performance.md).
VARIANTS = {"psum": {"one_shot_all_reduce_bytes": 0, "one_shot_all_gather_bytes": 0},
            "one_shot": {"one_shot_all_reduce_bytes": all_reduce.MAX_BYTES,
                         "one_shot_all_gather_bytes": all_reduce.MAX_BYTES}}


class _Bound:
    """A jitted step taking the all-reduce workspace's table last, as a (weights, batch, kv) step: lower/compile
    pass the table along."""

    def __init__(self, f, table):
        self.f, self.table = f, table

    def lower(self, *args):
        return _Bound(self.f.lower(*args, self.table), self.table)

    def compile(self):
        return _Bound(self.f.compile(), self.table)

    def __call__(self, *args):
        return self.f(*args, self.table)


def time_reduce(mesh, shape, dtype, ops, reps=200) -> float:
    """Microseconds per reduction of `shape` over the mesh as `ops.reduce` does it, reps in one executable (a loop:
    XLA's while loop adds its own per-iteration cost)."""
    reduce = replace(ops, axis=TP_AXIS).reduce
    table = all_reduce.workspace(mesh).table

    def body(x, table):
        with all_reduce.use(table):
            return jax.lax.fori_loop(0, reps, lambda i, y: reduce(y) * 0.5, x)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    x = jnp.ones(shape, dtype)
    c = f.lower(x, table).compile()
    jax.block_until_ready(c(x, table))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(c(x, table))
        best = min(best, time.perf_counter() - t)
    return best / reps * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    add_profile_argument(ap)
    ap.add_argument("--out")
    args = ap.parse_args()

    src = resolve_model(args.shape if "/" in args.shape else f"dummy:{args.shape}")
    cfg, dtype = src.config, DTYPES[args.dtype]
    ops = replace(select_ops(policy=KernelPolicy.from_env()), decode_step=True)
    rows = []
    for tp in args.tp:
        check_parallel(cfg, tp, args.expert_parallel)
        mesh = make_mesh(tp)
        t0 = time.perf_counter()
        w = shard_weights(cfg, load_weights(src, args.dtype, mesh, progress=False,
                                                      expert_parallel=args.expert_parallel), mesh,
                                    expert_parallel=args.expert_parallel)
        jax.block_until_ready(w)
        load_s = time.perf_counter() - t0
        pages_per_seq = (args.context + args.iters + 2) // args.page_size + 1
        num_pages = pages_per_seq * max(args.batch_sizes) + 1
        kv = init_kv_cache(cfg, num_pages, args.page_size, dtype, mesh)
        specs = (mesh, array_specs(w), array_specs(kv))

        def step_fn(name, specs=specs, mesh=mesh):
            """(ops, the step as a function of (weights, batch, kv))"""
            vops = replace(ops, policy=replace(ops.policy, **VARIANTS[name]))
            if not (table := all_reduce_table(mesh, vops)):
                return vops, jax.jit(mesh_forward(forward, cfg, vops, *specs), donate_argnums=(2,))
            f = jax.jit(mesh_forward(forward, cfg, vops, *specs, all_reduce_table=True), donate_argnums=(2,))
            return vops, _Bound(f, table[0])
        for bs in args.batch_sizes:
            pages = [list(range(1 + b * pages_per_seq, 1 + (b + 1) * pages_per_seq)) for b in range(bs)]
            batches = [jax.device_put(make_batch([([1], args.context + i, pg) for pg in pages], args.page_size,
                                                 pages_per_seq=pages_per_seq)) for i in range(args.iters)]
            for name in args.variants if tp > 1 else ["psum"]:
                row = {"tp": tp, "batch_size": bs, "variant": name, "weights_load_s": load_s}
                try:
                    t0 = time.perf_counter()
                    vops, step = step_fn(name)
                    c = step.lower(w, batches[0], kv).compile()
                    row["compile_s"] = time.perf_counter() - t0
                    logits, kv = c(w, batches[0], kv)
                    jax.block_until_ready(logits)
                    runs = []
                    for r in range(3):
                        jax.block_until_ready((logits, kv))
                        with profiled(args.profile and r == 2 and f"{args.profile}/tp{tp}_b{bs}_{name}"):
                            t = time.perf_counter()
                            for b in batches:
                                logits, kv = c(w, b, kv)
                            jax.block_until_ready(logits)
                        runs.append((time.perf_counter() - t) / args.iters * 1e3)
                    row["step_ms"], row["step_ms_runs"] = float(np.median(runs)), runs
                    if tp > 1:
                        row["reduce_us"] = time_reduce(mesh, (bs, cfg.hidden_size), dtype, vops)
                except Exception as e:  # noqa: BLE001 - an unsupported variant is a result, not a crash
                    row["error"] = f"{type(e).__name__}: {e}"[:400]
                rows.append(row)
                print({k: v for k, v in row.items() if k != "step_ms_runs"}, flush=True)
        del w, kv
    base = {r["batch_size"]: r["step_ms"] for r in rows if r["tp"] == 1 and "step_ms" in r}
    for r in rows:
        if r["tp"] > 1 and "step_ms" in r and r["batch_size"] in base:
            r["vs_tp1"] = r["step_ms"] / base[r["batch_size"]]
    write_result({"benchmark": "parallel_decode", **environment(), "shape": args.shape, "dtype": args.dtype,
                  "context": args.context, "expert_parallel": args.expert_parallel, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
