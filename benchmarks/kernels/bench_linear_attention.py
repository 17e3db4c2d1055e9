"""Timings of the gated delta rule's kernels at Qwen3.5-4B's linear-layer shapes (JSON lines on stdout).

    python -m benchmarks.kernels.bench_linear_attention recurrent [options]  # the recurrent kernel
    python -m benchmarks.kernels.bench_linear_attention chunked [options]    # the chunked (WY) form
    python -m benchmarks.kernels.bench_linear_attention intra [options]      # its intra-chunk kernel's settings

The decode step and the conv: benchmarks/kernels/bench_linear_attention_decode.py. On CPU: tiny shapes in the
interpreter, to check the script.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels import run_subcommand
from pallas_kernels.linear_attention.gated_delta_rule import recurrent_gated_delta_rule
from pallas_kernels.linear_attention.gated_delta_rule_chunked import (
    CHUNK,
    MIN_LEN,
    _chunk_state_call,
    chunk_layout,
    chunked_gated_delta_rule,
    max_chunks,
)
from pallas_kernels.linear_attention.gated_delta_rule_intra import (
    DIAG_INVERSES,
    OUTPUTS,
    intra_chunk,
    intra_chunk_pallas,
)


def bench_recurrent(argv: list[str] | None = None) -> None:
    """Kernel time at Qwen3.5-4B's linear-layer shapes (16 q/k heads, 32 v heads, 128 x 128 state), one
    layer: decode batches (state bytes read + written over time = TB/s) and one-sequence prefills (the
    recurrent walk; TFLOP/s of the rule's 6 Hv Dk Dv FLOPs per token). JSON lines on stdout. Small shapes
    on CPU (interpreter), to check the script."""
    import argparse
    import json
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--prefill", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--block-v", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4])
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    hk, hv, dk, dv = (16, 32, 128, 128) if gpu else (2, 4, 16, 16)
    if not gpu:
        args.batches, args.prefill, args.block_v = [2], [8], [16]
    rng = np.random.default_rng(0)

    def run(lens, block_v, warps):
        B, T = len(lens), sum(lens)
        qs = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
        q = jnp.asarray(rng.standard_normal((T, hk, dk)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((T, hk, dk)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((T, hv, dv)), jnp.bfloat16)
        g = jnp.asarray(-rng.uniform(0.01, 1, (T, hv)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0, 1, (T, hv)), jnp.float32)
        states = jnp.zeros((B + 1, hv, dk, dv), jnp.float32)
        slots, fresh = jnp.arange(1, B + 1, dtype=jnp.int32), jnp.zeros(B, bool)
        fn = functools.partial(recurrent_gated_delta_rule, block_v=block_v, num_warps=warps, interpret=not gpu)
        o, states = fn(q, k, v, g, beta, states, slots, fresh, qs)  # compile
        jax.block_until_ready(o)
        reps = 20 if gpu else 1
        t0 = time.perf_counter()
        for _ in range(reps):
            o, states = fn(q, k, v, g, beta, states, slots, fresh, qs)
        jax.block_until_ready((o, states))
        return (time.perf_counter() - t0) / reps

    dev = jax.devices()[0].device_kind
    for bv in args.block_v:
        for warps in args.num_warps:
            for B in args.batches:
                t = run([1] * B, bv, warps)
                nbytes = 2 * B * hv * dk * dv * 4
                print(json.dumps({"what": "decode", "device": dev, "batch": B, "block_v": bv, "num_warps": warps,
                                  "time_us": t * 1e6, "state_bytes": nbytes, "tb_per_s": nbytes / t / 1e12}))
            for n in args.prefill:
                t = run([n], bv, warps)
                flops = 6 * n * hv * dk * dv
                print(json.dumps({"what": "prefill", "device": dev, "tokens": n, "block_v": bv, "num_warps": warps,
                                  "time_us": t * 1e6, "tflop_per_s": flops / t / 1e12}))


def _bench_prefill(n, hk, hv, dk, dv, block_vs, warps_list, exacts, gpu, rng):
    """JSON records of the chunked rule on one fresh sequence of n rows (see `main`)."""
    import json
    import time

    C = CHUNK
    q = jnp.asarray(rng.standard_normal((n, hk, dk)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((n, hk, dk)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((n, hv, dv)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0.01, 1, (n, hv)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, (n, hv)), jnp.float32)
    qs = jnp.asarray([0, n], jnp.int32)
    slots, fresh = jnp.ones(1, jnp.int32), jnp.ones(1, bool)
    layout = jax.jit(chunk_layout, static_argnums=(1, 2, 3, 4))(qs, n, max_chunks(n, 1, C, MIN_LEN), C, MIN_LEN)
    rows, cs = layout["rows"], layout["chunk_start"]
    intra = jax.jit(intra_chunk)
    intra_kernel = functools.partial(intra_chunk_pallas, interpret=not gpu)
    try:  # bf16 parts, as the model's step feeds the recurrence
        parts = intra_kernel(q, k, v, g, beta, rows)
    except Exception as e:  # noqa: BLE001  (the records say so; the recurrence is timed on XLA's parts)
        print(json.dumps({"what": "intra_pallas", "tokens": n, "error": f"{type(e).__name__}: {str(e)[:300]}"}))
        parts, intra_kernel = intra(q, k, v, g, beta, rows), intra

    def timed(step, states):
        """Seconds per call of step(states) -> (out, states) (the pool is threaded: it may be donated)."""
        for _ in range(2):  # compile; the second call may compile again for the returned pool's layout
            out, states = step(states)
        jax.block_until_ready(out)
        reps = 10 if gpu else 1
        t0 = time.perf_counter()
        for _ in range(reps):
            out, states = step(states)
        jax.block_until_ready((out, states))
        return (time.perf_counter() - t0) / reps

    t_intra = timed(lambda s: (intra(q, k, v, g, beta, rows), s), None)
    trsm = jax.jit(functools.partial(intra_chunk, solve="trsm"))
    t_intra_trsm = timed(lambda s: (trsm(q, k, v, g, beta, rows), s), None)
    t_intra_pallas = timed(lambda s: (intra_kernel(q, k, v, g, beta, rows), s), None)
    # per token: QK^T and KK^T (4 C Dk), the triangular solve (C (Dk + Dv)), P V' (2 C Dv), the three state dots
    # (6 Dk Dv); the recurrent form does 6 Dk Dv
    useful = 6 * n * hv * dk * dv
    chunked = n * hv * (4 * C * dk + C * (dk + dv) + 2 * C * dv + 6 * dk * dv)
    out = []
    for i, (bv, warps, exact) in enumerate(itertools.product(block_vs, warps_list, exacts)):
        prec = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
        kern = jax.jit(functools.partial(_chunk_state_call, block_v=bv, num_warps=warps, num_stages=2,
                                         precision=prec, interpret=not gpu), donate_argnums=(1,))
        fn = functools.partial(chunked_gated_delta_rule, min_len=MIN_LEN, block_v=bv, num_warps=warps,
                               exact=bool(exact), interpret=not gpu)
        rec = {"what": "chunked_prefill", "device": jax.devices()[0].device_kind, "tokens": n, "block_v": bv,
               "num_warps": warps, "exact_dots": bool(exact)}
        try:  # a configuration Triton cannot compile (shared memory, registers) is a record, not the end
            t_kernel = timed(lambda s, kern=kern: kern(parts, s, slots, fresh, cs), jnp.zeros((2, hv, dk, dv)))
            t = timed(lambda s, fn=fn: fn(q, k, v, g, beta, s, slots, fresh, qs), jnp.zeros((2, hv, dk, dv)))
            extra = {}
            if i == 0:  # the whole function as it was: XLA's intra-chunk part (float32 parts)
                fj = functools.partial(fn, intra="jnp")
                extra["time_jnp_intra_us"] = timed(lambda s, fj=fj: fj(q, k, v, g, beta, s, slots, fresh, qs),
                                                   jnp.zeros((2, hv, dk, dv))) * 1e6
        except Exception as e:  # noqa: BLE001
            out.append(rec | {"error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        out.append(rec | extra | {"time_us": t * 1e6, "intra_chunk_us": t_intra * 1e6,
                                  "intra_chunk_trsm_us": t_intra_trsm * 1e6, "intra_pallas_us": t_intra_pallas * 1e6,
                                  "recurrence_kernel_us": t_kernel * 1e6, "tflop_per_s": useful / t / 1e12,
                                  "chunked_form_tflop_per_s": chunked / t / 1e12})
    return out


def bench_chunked(argv: list[str] | None = None) -> None:
    """Time of the chunked rule at Qwen3.5-4B's linear-layer shapes (16 q/k heads, 32 v heads, 128 x 128
    state), one layer, one fresh sequence of 1k and 16k tokens: the whole function (the intra-chunk kernel +
    the recurrence kernel; for the first configuration also with XLA's intra-chunk part: time_jnp_intra_us),
    and each part alone (intra_chunk_us: XLA's, product-form inverse; intra_chunk_trsm_us: with XLA's
    triangular solve; intra_pallas_us: the kernel, default settings; recurrence_kernel_us: fed the kernel's
    bf16 parts). gated_delta_rule_intra times the intra-chunk kernel's settings. tflop_per_s
    counts the rule's 6 Hv Dk Dv FLOPs per token (the recurrent form's useful work, as the recurrent kernel's
    benchmark does: comparable); chunked_form_tflop_per_s the chunked form's own FLOPs. JSON lines on stdout.
    Small shapes on CPU (interpreter), to check the script."""
    import argparse
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--block-v", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--exact", type=int, nargs="+", default=[0, 1])
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    hk, hv, dk, dv = (16, 32, 128, 128) if gpu else (2, 4, 16, 32)
    if not gpu:
        args.prefill, args.block_v, args.exact = [80], [16], [0]
    rng = np.random.default_rng(0)
    for n in args.prefill:
        for rec in _bench_prefill(n, hk, hv, dk, dv, args.block_v, args.num_warps, args.exact, gpu, rng):
            print(json.dumps(rec))


def bench_intra(argv: list[str] | None = None) -> None:
    """Time of the intra-chunk part at Qwen3.5-4B's linear-layer shapes (16 q/k heads, 32 v heads, 128 x 128),
    one layer, one sequence of 1k and 16k tokens (bf16 activations): XLA's (`intra_chunk`, product-form
    inverse and triangular solve) and the kernel's settings (warps, diagonal inverse, stored dtype, exact
    dots). hbm_gb_per_s: the kernel's least traffic (activations read once, outputs written once) over its
    time; max_rel_err: the largest |kernel - XLA's triangular solve| over each output's largest entry. JSON
    lines on stdout. Small shapes on CPU (interpreter), to check the script."""
    import argparse
    import json
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, nargs="+", default=[1024, 16384])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--heads-per-program", type=int, nargs="+", default=[1, 2],
                    help="value heads per program (the default settings only, beyond 1)")
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    hk, hv, dk, dv = (16, 32, 128, 128) if gpu else (2, 4, 16, 32)
    if not gpu:
        args.prefill, args.num_warps = [80], [4]
    configs = [(w, d, dt, False, 1) for w in args.num_warps for d in DIAG_INVERSES for dt in ("bfloat16", "float32")]
    configs.append((args.num_warps[0], "products", "bfloat16", True, 1))
    configs += [(w, "products", "bfloat16", False, n) for n in args.heads_per_program if n > 1 for w in args.num_warps]
    rng = np.random.default_rng(0)
    dev = jax.devices()[0].device_kind

    def timed(fn, *xs):
        for _ in range(2):  # compile (the interpreter's first call changes the tracing context: a second compile)
            out = fn(*xs)
        jax.block_until_ready(out)
        reps = 20 if gpu else 1
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*xs)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / reps, out

    for n in args.prefill:
        q = jnp.asarray(rng.standard_normal((n, hk, dk)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((n, hk, dk)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((n, hv, dv)), jnp.bfloat16)
        g = jnp.asarray(-rng.uniform(0.01, 1, (n, hv)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0, 1, (n, hv)), jnp.float32)
        qs = jnp.asarray([0, n], jnp.int32)
        nc = max_chunks(n, 1, CHUNK, MIN_LEN)
        rows = jax.jit(chunk_layout, static_argnums=(1, 2, 3, 4))(qs, n, nc, CHUNK, MIN_LEN)["rows"]
        used = -(-n // CHUNK)
        base = {"what": "intra_chunk", "device": dev, "tokens": n, "chunks": used}
        xs = (q, k, v, g, beta, rows)
        t_jnp, _ = timed(jax.jit(intra_chunk), *xs)
        t_trsm, ref = timed(jax.jit(functools.partial(intra_chunk, solve="trsm")), *xs)
        print(json.dumps(base | {"impl": "xla_product", "time_us": t_jnp * 1e6}))
        print(json.dumps(base | {"impl": "xla_trsm", "time_us": t_trsm * 1e6}))
        for warps, diag, dtype, exact, heads in configs:
            rec = base | {"impl": "pallas", "num_warps": warps, "diag_inverse": diag, "parts_dtype": dtype,
                          "exact_dots": exact, "heads_per_program": heads}
            fn = functools.partial(intra_chunk_pallas, out_dtype=jnp.dtype(dtype), exact=exact, diag_inverse=diag,
                                   num_warps=warps, heads_per_program=heads, interpret=not gpu)
            try:  # a configuration Triton cannot compile is a record, not the end
                t, got = timed(fn, *xs)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(rec | {"error": f"{type(e).__name__}: {str(e)[:300]}"}))
                continue
            err = max(float(jnp.abs(got[x][:used].astype(jnp.float32) - ref[x][:used]).max()
                            / jnp.abs(ref[x][:used]).max()) for x in OUTPUTS)
            size = jnp.dtype(dtype).itemsize
            nbytes = n * (2 * hk * dk * 2 + hv * dv * 2 + 2 * hv * 4) + used * hv * CHUNK * (
                (3 * dk + dv + CHUNK) * size) + used * hv * 4
            print(json.dumps(rec | {"time_us": t * 1e6, "speedup_vs_xla": t_jnp / t, "hbm_bytes": nbytes,
                                    "hbm_gb_per_s": nbytes / t / 1e9, "max_rel_err": err}))


BENCHMARKS = {"recurrent": bench_recurrent, "chunked": bench_chunked, "intra": bench_intra}

def main(argv: list[str] | None = None) -> None:
    run_subcommand(BENCHMARKS, __spec__.name, __doc__, argv)


if __name__ == "__main__":
    main()
