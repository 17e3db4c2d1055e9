"""Timings of the mixture-of-experts kernels (the full comparison is benchmarks/bench_moe.py).

    python -m benchmarks.kernels.bench_moe routing          # the routing kernels vs XLA
    python -m benchmarks.kernels.bench_moe gemm             # the Triton grouped GEMMs
    python -m benchmarks.kernels.bench_moe gemm_mgpu [--sweep]  # the Mosaic GPU grouped GEMM (one JSON on stdout)

On CPU: tiny shapes in the interpreters, to check the script.
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from benchmarks.kernels import run_subcommand
from pallas_kernels.moe.moe_gemm import moe_combine, moe_down, moe_gate_up
from pallas_kernels.moe.moe_gemm_mgpu import (
    MAX_ACC_REGISTERS,
    SMEM_BYTES,
    _acc_registers,
    moe_grouped_matmul_mgpu,
    moe_grouped_matmul_reference,
    smem_bytes,
)
from pallas_kernels.moe.moe_routing import (
    moe_route,
    moe_route_chosen,
    moe_route_chosen_reference,
    moe_route_reference,
)


def bench_routing(argv: list[str] | None = None) -> None:
    """Routing time, kernel vs XLA: softmax top-k at Qwen3-30B-A3B's 128 experts, top-8 (`moe_route`), and the layout
    of experts chosen by DeepSeek's routing at V2-Lite's 64 experts, top-6 and V3's 256, top-8 (`moe_route_chosen`)."""
    interpret = jax.default_backend() != "gpu"
    for tokens in (1, 8, 64, 256):
        logits = jax.random.normal(jax.random.key(tokens), (tokens, 128), jnp.float32)
        for name, fn in (("pallas", functools.partial(moe_route, interpret=interpret)),
                         ("xla", moe_route_reference)):
            _time_routing(f"route T={tokens} {name}", functools.partial(fn, top_k=8, block_m=16), logits)
    for experts, k in ((64, 6), (256, 8)):
        for tokens in (1, 8, 64, 256):
            w, ids = jax.lax.top_k(jax.random.normal(jax.random.key(tokens), (tokens, experts), jnp.float32), k)
            for name, fn in (("pallas", functools.partial(moe_route_chosen, interpret=interpret)),
                             ("xla", moe_route_chosen_reference)):
                _time_routing(f"route_chosen E={experts} k={k} T={tokens} {name}",
                              functools.partial(fn, num_experts=experts, block_m=16), ids, w)


def _time_routing(label, fn, *args):
    import time

    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    reps = 200 if jax.default_backend() == "gpu" else 2
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(*args)
    jax.block_until_ready(out)
    print(f"{label}: {(time.perf_counter() - t0) / reps * 1e6:.1f} us")


def bench_gemm(argv: list[str] | None = None) -> None:
    """Quick timing at Qwen3-30B-A3B expert shapes; the full comparison is benchmarks/bench_moe.py."""
    import time

    from pallas_kernels.moe.moe_routing import moe_route

    interpret = jax.default_backend() != "gpu"
    e, hidden, inter, k = (128, 2048, 768, 8) if not interpret else (8, 128, 64, 2)
    key = jax.random.key(0)
    kg, ku, kd, kx, kr = jax.random.split(key, 5)
    wg = (jax.random.normal(kg, (e, hidden, inter), jnp.float32) * 0.02).astype(jnp.bfloat16)
    wu = (jax.random.normal(ku, (e, hidden, inter), jnp.float32) * 0.02).astype(jnp.bfloat16)
    wd = (jax.random.normal(kd, (e, inter, hidden), jnp.float32) * 0.02).astype(jnp.bfloat16)
    for tokens in (1, 8, 64):
        x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
        r = moe_route(jax.random.normal(kr, (tokens, e)), top_k=k, block_m=16, interpret=interpret)

        def mlp(x, r):
            return moe_combine(moe_down(moe_gate_up(x, r, wg, wu, interpret=interpret), r, wd, interpret=interpret),
                               k, x.dtype)

        f = jax.jit(mlp)
        f(x, r).block_until_ready()
        reps = 2 if interpret else 100
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f(x, r)
        out.block_until_ready()
        dt = (time.perf_counter() - t0) / reps
        hit = len(set(jax.device_get(r.topk_ids).ravel().tolist()))
        gb = hit * 3 * hidden * inter * 2 / 1e9
        print(f"moe T={tokens}: {dt * 1e6:.1f} us, {hit} experts, {gb / dt / 1e3:.2f} TB/s")


def random_layout(key, tokens: int, top_k: int, num_experts: int, block_m: int, hidden: int, dtype=jnp.bfloat16):
    """A routed layout of `tokens * top_k` rows: each token picks top_k distinct experts uniformly at
    random, each expert's segment is padded to block_m, and M is the worst case's padded row count
    (the engine's static shape: tokens * top_k + E * (block_m - 1), rounded up to block_m).

    Returns (x [M, hidden] random, block_expert [M // block_m] (-1 for the unused tail),
    block_rows [M // block_m] (valid rows per block), used rows = used blocks x block_m)."""
    import numpy as np

    kr, kx = jax.random.split(key)
    choice = np.asarray(jnp.argsort(jax.random.uniform(kr, (tokens, num_experts)), axis=1)[:, :top_k])
    counts = np.bincount(choice.ravel(), minlength=num_experts)
    blocks = -(-counts // block_m)
    num_blocks = -(-(tokens * top_k + num_experts * (block_m - 1)) // block_m)
    block_expert = np.full((num_blocks,), -1, np.int32)
    block_expert[:blocks.sum()] = np.repeat(np.arange(num_experts, dtype=np.int32), blocks)
    block_rows = np.zeros((num_blocks,), np.int32)
    block_rows[:blocks.sum()] = np.concatenate(
        [np.minimum(c - block_m * np.arange(nb), block_m) for c, nb in zip(counts, blocks) if nb])
    x = jax.random.normal(kx, (num_blocks * block_m, hidden), jnp.float32).astype(dtype)
    return x, jnp.asarray(block_expert), jnp.asarray(block_rows), int(blocks.sum()) * block_m


def _time_us(fn, *args, iterations: int = 20) -> tuple[float, str]:
    """Median time of `fn(*args)` in us after warm-up calls: CUPTI kernel time (all kernels of one
    call) when available, else wall clock around block_until_ready. Returns (us, method)."""
    import statistics
    import time

    for _ in range(3):
        jax.block_until_ready(fn(*args))
    try:
        from jax.experimental.mosaic.gpu import profiler

        _, runs = profiler.measure(fn, iterations=iterations)(*args)
        if runs:
            return statistics.median(runs) * 1e3, "cupti"
    except Exception:  # noqa: BLE001 - CUPTI unavailable: fall back to the wall clock
        pass
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6, "wall"


def _check_subset(out, x, w, block_expert, w2, block_rows, block_m, num_blocks=24) -> float:
    """Max abs error against the reference on the valid rows of a sample of used blocks (the reference
    gathers a weight matrix per block, so the full layout would not fit); raises past bf16 tolerance."""
    import numpy as np

    be, br = np.asarray(block_expert), np.asarray(block_rows)
    used = np.flatnonzero(be >= 0)
    pick = used[np.linspace(0, len(used) - 1, min(num_blocks, len(used))).astype(int)]
    rows = (pick[:, None] * block_m + np.arange(block_m)[None]).ravel()
    valid = (np.arange(block_m)[None] < br[pick][:, None]).ravel()
    ref = moe_grouped_matmul_reference(x[rows], w, jnp.asarray(be[pick]), w2, block_m=block_m)
    got = np.asarray(out[rows].astype(jnp.float32))[valid]
    ref = np.asarray(ref.astype(jnp.float32))[valid]
    if not np.allclose(got, ref, atol=2e-2, rtol=2e-2):
        raise AssertionError(f"kernel differs from the reference: max abs err {np.abs(got - ref).max()}")
    return float(np.abs(got - ref).max())


def bench_gemm_mgpu(argv: list[str] | None = None) -> None:
    """`python -m pallas_kernels.moe.moe_gemm_mgpu [--sweep]`: Qwen3-30B-A3B's expert GEMMs (E = 128,
    hidden 2048, moe_intermediate 768, top-8, bf16, uniform random routing) at 4096 tokens (and 1024,
    512) x top-8: (a) gate|up with the SwiGLU epilogue, (b) down. Default config, and the default
    with `block_rows`; with `--sweep` a grid of the knobs at 4096 tokens (~25 configs). Per config:
    median kernel time of 20 calls, TFLOP/s on the real routed rows (`tflops`: tokens x 8), on the
    rows of used blocks incl. padding (`tflops_padded`) and on the rows the tensor cores multiply
    (`tflops_computed`: less than the padded ones with block_rows), max error on a sample of blocks. Progress
    lines go to stderr; one JSON line to stdout at the end. (On CPU: a smoke run on tiny shapes in
    the interpreter.)"""
    import numpy as np

    argv = sys.argv[1:] if argv is None else argv
    sweep = "--sweep" in argv
    interpret = jax.default_backend() != "gpu"
    if interpret:
        e, hidden, inter, top_k, token_counts = 4, 128, 128, 2, (64,)
    else:
        e, hidden, inter, top_k, token_counts = 128, 2048, 768, 8, (4096, 1024, 512)
    kg, ku, kd, kx = jax.random.split(jax.random.key(0), 4)
    wg = (jax.random.normal(kg, (e, hidden, inter), jnp.float32) * hidden**-0.5).astype(jnp.bfloat16)
    wu = (jax.random.normal(ku, (e, hidden, inter), jnp.float32) * hidden**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(kd, (e, inter, hidden), jnp.float32) * inter**-0.5).astype(jnp.bfloat16)
    result = {"kernel": "moe_grouped_matmul_mgpu", "device": jax.devices()[0].device_kind, "experts": e,
              "hidden": hidden, "intermediate": inter, "top_k": top_k, "runs": []}
    layouts = {}

    def run(tokens, block_m, kind, use_rows=False, **knobs):
        if (tokens, block_m) not in layouts:
            layouts[tokens, block_m] = random_layout(kx, tokens, top_k, e, block_m, hidden)
        x, be, br, used_rows = layouts[tokens, block_m]
        if kind == "gate_up":
            args, n, k = (x, wg, be, wu), inter, hidden
        else:  # down: its input is an [M, I] activation in the same layout
            args, n, k = (jnp.tile(x, (1, pl.cdiv(inter, hidden)))[:, :inter], wd, be), hidden, inter
        fn = jax.jit(functools.partial(moe_grouped_matmul_mgpu, block_m=block_m, interpret=interpret, **knobs))
        if use_rows:
            fn = functools.partial(fn, block_rows=br)
        computed_rows = used_rows
        if use_rows and block_m % 128 == 0 and knobs.get("wg_split", "m") == "m":  # 64-row halves skipped
            computed_rows = int((-(-np.asarray(br) // (block_m // 2))).sum()) * (block_m // 2)
        entry = {"kind": kind, "tokens": tokens, "block_m": block_m, "block_rows": use_rows, **knobs,
                 "rows": x.shape[0], "used_rows": used_rows, "computed_rows": computed_rows,
                 "real_rows": tokens * top_k}
        try:
            out = fn(*args)
            entry["max_abs_err"] = _check_subset(out, args[0], args[1], be, args[3] if len(args) == 4 else None,
                                                 br, block_m)
            us, entry["timer"] = _time_us(fn, *args, iterations=2 if interpret else 20)
        except Exception as err:  # noqa: BLE001 - a config that does not compile / fit: record it, go on
            entry["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        else:
            flops = 2 * k * n * (2 if kind == "gate_up" else 1)
            entry.update(us=round(us, 1), tflops=round(flops * tokens * top_k / us / 1e6, 1),
                         tflops_padded=round(flops * used_rows / us / 1e6, 1),
                         tflops_computed=round(flops * computed_rows / us / 1e6, 1))
        result["runs"].append(entry)
        print(json.dumps(entry), file=sys.stderr, flush=True)

    for tokens in token_counts:
        for kind in ("gate_up", "down"):
            run(tokens, 128, kind)
            run(tokens, 128, kind, use_rows=True)
    if sweep:  # ~25 configs: tiles x warpgroup split x ring depth (2 slots only where no deeper ring fits)
        tokens = token_counts[0]
        for block_m in (128, 64):
            for kind in ("gate_up", "down"):
                n, weights = (inter, 2) if kind == "gate_up" else (hidden, 1)
                for block_n, block_k in ((128, 64), (256, 64), (128, 128)):
                    for wg_split in ("m", "n") if block_m % 128 == 0 else ("n",):
                        if (n % block_n or (wg_split == "n" and block_n % 128) or (block_k == 128 and weights == 2)
                                or _acc_registers(block_m, block_n, weights) > MAX_ACC_REGISTERS):
                            continue
                        steps = [s for s in (2, 3, 4, 5)
                                 if smem_bytes(block_m, block_n, block_k, s, weights) <= SMEM_BYTES]
                        for max_steps in steps[1:] or steps:
                            run(tokens, block_m, kind, block_n=block_n, block_k=block_k, max_steps=max_steps,
                                wg_split=wg_split)
    print(json.dumps(result))


BENCHMARKS = {"routing": bench_routing, "gemm": bench_gemm, "gemm_mgpu": bench_gemm_mgpu}

def main(argv: list[str] | None = None) -> None:
    run_subcommand(BENCHMARKS, __spec__.name, __doc__, argv)


if __name__ == "__main__":
    main()
