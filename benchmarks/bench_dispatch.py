"""The host's cost of passing a model's weights to a jitted call, per call: the weights as their pytree (JAX flattens
it and checks its structure at every call) against their flat leaves (flattened once; the runner's way,
device_step.forward_step's `weights_tree`). Qwen3-8B's tree (36 layers of `LayerWeights`, q|k|v fused; `--fp8`:
the five linear weights of a layer as `Fp8Weight` nodes), tiny arrays: only the dispatch is timed (a jitted
function that reads none of them).

    python -m benchmarks.bench_dispatch --out benchmarks/results/dispatch_cpu.json   # bf16 and FP8 trees
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_result
from jinfer.models.base import LayerWeights
from jinfer.models.fp8 import Fp8Weight

LINEAR = ("wqkv", "wo", "w_gate", "w_up", "w_down")


def layer(fp8: bool) -> LayerWeights:
    """One decoder layer's fields as the engine holds them (fused q|k|v, q/k norms, no biases)."""
    fields = ("attn_norm", "mlp_norm", "q_norm", "k_norm", *LINEAR)
    a = jnp.ones((4, 4), jnp.float32)
    kw = {f: Fp8Weight(a.astype(jnp.float8_e4m3fn), jnp.ones((1, 1)), (4, 4), True) if fp8 and f in LINEAR else a
          for f in fields}
    return LayerWeights(**{f.name: None for f in dataclasses.fields(LayerWeights)} | kw)


def per_call_us(fn, args, calls: int) -> float:
    for _ in range(50):
        jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    x = jnp.ones(())
    rows = []
    for fp8 in (False, True):
        tree = [layer(fp8) for _ in range(args.layers)]
        leaves, treedef = jax.tree.flatten(tree)
        as_tree = jax.jit(lambda w, x: x + 1, keep_unused=True)  # (the engine's forward keeps every argument)
        as_leaves = jax.jit(lambda w, x: x + 1, keep_unused=True)
        times = {"tree": [], "leaves": []}
        for _ in range(args.rounds):
            times["tree"].append(per_call_us(as_tree, (tree, x), args.calls))
            times["leaves"].append(per_call_us(as_leaves, (tuple(leaves), x), args.calls))
        row = {"weights": "fp8" if fp8 else "bf16", "leaves": len(leaves),
               **{f"{k}_us": round(float(np.median(v)), 1) for k, v in times.items()},
               **{f"{k}_rounds_us": [round(t, 1) for t in v] for k, v in times.items()}}
        rows.append(row)
        print(row, flush=True)
    write_result({"benchmark": "dispatch", **environment(), "layers": args.layers, "results": rows}, args.out)


if __name__ == "__main__":
    main()
