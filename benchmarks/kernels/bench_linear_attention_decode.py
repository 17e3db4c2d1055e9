"""Timings of Qwen3.5-4B's linear-layer decode step and conv kernels (JSON lines on stdout).

    python -m benchmarks.kernels.bench_linear_attention_decode decode [options]  # the fused decode step
    python -m benchmarks.kernels.bench_linear_attention_decode conv [options]    # the causal conv

JINFER_COMMIT (set by the GPU scripts' caller) names the tree that ran in each line. On CPU: tiny shapes in the
interpreter, to check the script.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.kernels import run_subcommand
from pallas_kernels.linear_attention.causal_conv import causal_conv, conv_reference
from pallas_kernels.linear_attention.gated_delta_rule_decode import fused_decode_step, gates


def bench_decode(argv: list[str] | None = None) -> None:
    """One Qwen3.5-4B linear layer's decode step (16 q/k heads, 32 v heads, 128 x 128 state, conv of 4 taps over
    8192 channels) at decode batches: the fused kernel (blocks of value columns, warps; with and without the gated
    norm) against the general path (the conv in XLA, the recurrent kernel, the gated-norm kernel). Each figure
    times `--reps` steps chained in one executable (each step reads the pools the previous one wrote, as decode
    does), so no dispatch is timed. TB/s on the recurrent state's bytes (read + written), the issue's measure.
    JSON lines on stdout; tiny shapes on CPU (interpreter) to check it."""
    import argparse
    import json
    import os
    import time

    import numpy as np

    from pallas_kernels.linear_attention.causal_conv import causal_conv_reference
    from pallas_kernels.linear_attention.gated_delta_rule import recurrent_gated_delta_rule
    from pallas_kernels.linear_attention.gated_delta_rule_common import token_sequences
    from pallas_kernels.linear_attention.gated_rms_norm import gated_rms_norm

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--block-v", type=int, nargs="+", default=[128, 64, 32])
    ap.add_argument("--evict", nargs="+", default=["auto"], help="the state's eviction policy: auto (the kernel's "
                    "default) none evict_first evict_last")
    ap.add_argument("--no-plain", dest="plain", action="store_false", help="only the kernel with the gated norm")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every variant (median reported)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    hk, hv, dk, dv, taps = (16, 32, 128, 128, 4) if gpu else (2, 4, 16, 16, 4)
    if not gpu:
        args.batches, args.num_warps, args.reps, args.block_v, args.rounds = [2], [4], 2, [16], 1
    C, vs = 2 * hk * dk + hv * dv, hv * dv
    rng = np.random.default_rng(0)
    dev = jax.devices()[0].device_kind
    commit = os.environ.get("JINFER_COMMIT")  # the tree that ran (set by the GPU scripts' caller)

    loops: dict = {}

    def timed(step, conv, states, key=None):
        """Seconds per step: `reps` steps unrolled in one executable (an XLA while loop costs a host round trip
        per iteration, ~10 us); each reads the pools the previous one wrote, in place (donated). `key` keeps the
        executable for later rounds."""
        if key is not None and key in loops:
            loop = loops[key]
            conv, states, _ = loop(conv, states)
            jax.block_until_ready((conv, states))
            return best_of(loop, conv, states)

        def loop(c, s):
            acc = jnp.zeros((), jnp.float32)
            for _ in range(args.reps):
                c, s, o = step(c, s)
                acc = acc + o[0, 0, 0]  # the output is used, but not copied
            return c, s, acc

        loop = jax.jit(loop, donate_argnums=(0, 1))
        if key is not None:
            loops[key] = loop
        conv, states, _ = loop(conv, states)  # compile
        jax.block_until_ready((conv, states))
        return best_of(loop, conv, states)

    def best_of(loop, conv, states):
        best = float("inf")
        for _ in range(3):  # the best of three
            t0 = time.perf_counter()
            conv, states, acc = loop(conv, states)
            jax.block_until_ready((conv, states, acc))
            best = min(best, (time.perf_counter() - t0) / args.reps)
        return best

    def batch(B: int) -> None:
        proj = jnp.asarray(rng.standard_normal((B, C + vs + 2 * hv)), jnp.bfloat16)  # mixed | z | b | a
        mixed, z = proj[:, :C], proj[:, C:C + vs].reshape(B, hv, dv)
        b, a = proj[:, C + vs:C + vs + hv], proj[:, C + vs + hv:]
        w = jnp.asarray(rng.standard_normal((C, 1, taps)) * 0.3, jnp.bfloat16)
        a_log, dt_bias = jnp.zeros(hv, jnp.float32), jnp.ones(hv, jnp.float32)
        norm_w = jnp.asarray(rng.standard_normal(dv), jnp.bfloat16)
        slots, fresh = jnp.arange(1, B + 1, dtype=jnp.int32), jnp.zeros(B, bool)
        positions = jnp.full((B,), 1000, jnp.int32)
        qs = jnp.arange(B + 1, dtype=jnp.int32)
        pools = lambda: (jnp.zeros((B + 1, taps, C), jnp.bfloat16),  # noqa: E731
                         jnp.zeros((B + 1, hv, dk, dv), jnp.float32))
        state_bytes = 2 * B * hv * dk * dv * 4
        row = {"device": dev, "commit": commit, "batch": B, "state_bytes": state_bytes}

        def general(conv, states):
            y, conv = causal_conv_reference(mixed, conv, w, token_sequences(qs, B), qs[:-1], qs, slots, positions)
            q, k, v = jnp.split(y, [hk * dk, 2 * hk * dk], axis=-1)
            beta, g = gates(b, a, a_log, dt_bias)
            o, states = recurrent_gated_delta_rule(q.reshape(B, hk, dk), k.reshape(B, hk, dk), v.reshape(B, hv, dv),
                                                   g, beta, states, slots, fresh, qs, interpret=not gpu)
            o = gated_rms_norm(o.astype(proj.dtype), z, norm_w, eps=1e-6, interpret=not gpu)
            return conv, states, o

        t = timed(general, *pools())
        print(json.dumps(row | {"path": "general (XLA conv + recurrent kernel + gated norm kernel)",
                                "time_us": t * 1e6, "tb_per_s": state_bytes / t / 1e12}))
        variants = [(norm, bv, warps, ev) for norm in (True, False)[:2 if args.plain else 1]
                    for bv in args.block_v for warps in args.num_warps for ev in args.evict]
        times: dict = {}
        for r in range(args.rounds):  # interleaved rounds: a variant's median is over machine states
            for norm, bv, warps, ev in variants:
                def fused(conv, states, warps=warps, norm=norm, bv=bv, ev=ev):
                    kw = dict(z_col=C, norm_weight=norm_w) if norm else {}
                    o, conv, states = fused_decode_step(proj, conv, w, a_log, dt_bias, states, slots, positions,
                                                        fresh, num_k_heads=hk, key_dim=dk, value_dim=dv,
                                                        b_col=C + vs, a_col=C + vs + hv, block_v=bv,
                                                        evict=None if ev == "none" else ev,  # auto too
                                                        num_warps=warps, interpret=not gpu, **kw)
                    return conv, states, o

                t = timed(fused, *pools(), key=(B, norm, bv, warps, ev))
                times.setdefault((norm, bv, warps, ev), []).append(t)
                if r == args.rounds - 1:
                    ts = sorted(times[(norm, bv, warps, ev)])
                    med = ts[len(ts) // 2]
                    print(json.dumps(row | {"path": "fused" + (" + gated norm" if norm else ""), "block_v": bv,
                                            "num_warps": warps, "evict": ev, "rounds": len(ts),
                                            "time_us": med * 1e6, "time_us_rounds": [x * 1e6 for x in ts],
                                            "tb_per_s": state_bytes / med / 1e12}), flush=True)

    for B in args.batches:
        batch(B)


def bench_conv(argv: list[str] | None = None) -> None:
    """Qwen3.5-4B's linear-layer conv (8192 channels, 4 taps) over the steps of offline serving: a prefill-only
    step (8 sequences x 1024 rows), a mixed one (256 one-row sequences + 7936 rows of 8 sequences), a decode-sized
    one (256 one-row sequences): XLA's form (`conv_reference`) against the kernel (block sizes). GB/s on x read +
    y written. JSON lines on stdout; tiny shapes on CPU (interpreter) to check it."""
    import argparse
    import json
    import os
    import time

    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--blocks", nargs="+", default=["32x128", "16x128", "32x64", "64x64", "16x256"])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 2, 8])
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    C, K = (8192, 4) if gpu else (256, 4)
    steps = {"prefill 8 x 1024": [1024] * 8, "mixed 256 x 1 + 8 x 992": [1] * 256 + [992] * 8,
             "decode 256 x 1": [1] * 256} if gpu else {"mixed": [1, 1, 5, 3], "decode": [1, 1]}
    if not gpu:
        args.blocks, args.reps, args.num_warps = ["8x128"], 1, [4]
    rng = np.random.default_rng(0)
    dev = jax.devices()[0].device_kind
    commit = os.environ.get("JINFER_COMMIT")
    for name, lens in steps.items():
        B, T = len(lens), sum(lens)
        qs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        seq = np.repeat(np.arange(B), lens).astype(np.int32)
        positions = np.concatenate([np.arange(500, 500 + n) for n in lens]).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((T, C)), jnp.bfloat16)
        pool = jnp.asarray(rng.standard_normal((B + 1, K, C)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((C, 1, K)) * 0.3, jnp.bfloat16)
        slots = jnp.arange(1, B + 1, dtype=jnp.int32)
        ops = (x, pool, w, jnp.asarray(seq), jnp.asarray(qs[:-1]), slots, jnp.asarray(positions))
        want = conv_reference(*ops)
        row = {"device": dev, "commit": commit, "step": name, "rows": T, "channels": C}

        def timed(fn, ops=ops):
            def loop(x, *rest):
                for _ in range(args.reps):  # each rep's input is the last one's output (same shape and dtype)
                    x = fn(x, *rest)
                return x

            loop = jax.jit(loop)
            jax.block_until_ready(loop(*ops))
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(loop(*ops))
                best = min(best, (time.perf_counter() - t0) / args.reps)
            return best

        nbytes = 2 * T * C * 2
        t = timed(conv_reference)
        print(json.dumps(row | {"impl": "xla", "time_us": t * 1e6, "gb_per_s": nbytes / t / 1e9}), flush=True)
        for blocks in args.blocks:
            for warps in args.num_warps:
                bt, bc = map(int, blocks.split("x"))
                fn = functools.partial(causal_conv, block_t=bt, block_c=bc, num_warps=warps, interpret=not gpu)
                err = float(jnp.max(jnp.abs(fn(*ops).astype(jnp.float32) - want.astype(jnp.float32))))
                t = timed(fn)
                print(json.dumps(row | {"impl": "pallas", "block_t": bt, "block_c": bc, "num_warps": warps,
                                        "time_us": t * 1e6, "gb_per_s": nbytes / t / 1e9, "max_err_vs_xla": err}),
                      flush=True)


BENCHMARKS = {"decode": bench_decode, "conv": bench_conv}

def main(argv: list[str] | None = None) -> None:
    run_subcommand(BENCHMARKS, __spec__.name, __doc__, argv)


if __name__ == "__main__":
    main()
