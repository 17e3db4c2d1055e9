"""Where the fused Gated DeltaNet decode kernel's time goes: simpler kernels on the same grid and state pool,
each timed like `python -m benchmarks.kernels.bench_linear_attention_decode decode` (`--reps` steps chained in one
executable,
each reading the pool the previous one wrote, donated), TB/s on the state's bytes (read + written).

- `copy`: each program loads its [Dk, Dv] float32 state slice, scales it by a value read from the input row and
  stores it back: the floor of this access pattern (one 64 KB slice per program).
- `copy_vsplit`: the same with the value columns split over `--block-v` programs.
- `rule`: the delta rule with q, k, v, beta and the decay read straight from the input (no conv, no norm).
- `rule_vsplit`: the same over blocks of value columns (the rule is separable along Dv).
- `fused`: the engine's kernel (conv, gates, rule; with and without the gated norm).

Qwen3.5-4B's linear layer: 16 key heads, 32 value heads, 128 x 128 state. JSON lines on stdout."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.linear_attention.gated_delta_rule_decode import fused_decode_step


def _copy_kernel(slot_ref, x_ref, s_in_ref, s_ref, *, bv: int):
    del s_in_ref
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ref[i]
    cols = pl.ds(j * bv, bv)
    state = s_ref[slot, h, :, cols]
    s_ref[slot, h, :, cols] = state * x_ref[i, h].astype(jnp.float32)


def _copy_pipe_kernel(slot_ref, x_ref, s_in_ref, s_ref, *, n: int, hv: int, evict: bool):
    """n consecutive heads of one sequence, each head's load issued before the previous head's store."""
    del s_in_ref
    p = pl.program_id(0)
    i, h0 = p // (hv // n), (p % (hv // n)) * n
    slot = slot_ref[i]
    kw = dict(eviction_policy="evict_first") if evict else {}
    cur = plgpu.load(s_ref.at[slot, h0], **kw)
    for j in range(n):
        nxt = plgpu.load(s_ref.at[slot, h0 + j + 1], **kw) if j + 1 < n else None
        plgpu.store(s_ref.at[slot, h0 + j], cur * x_ref[i, h0 + j].astype(jnp.float32), **kw)
        cur = nxt


def _rule_pipe_kernel(slot_ref, x_ref, s_in_ref, o_ref, s_ref, *, n: int, hk: int, hv: int, dk: int, dv: int):
    """`_rule_kernel` over n consecutive heads of one sequence, each head's state load issued before the previous
    head's update and store."""
    del s_in_ref
    p = pl.program_id(0)
    i, h0 = p // (hv // n), (p % (hv // n)) * n
    slot = slot_ref[i]
    group = hv // hk
    cur = s_ref[slot, h0]
    for j in range(n):
        h = h0 + j
        nxt = s_ref[slot, h + 1] if j + 1 < n else None
        kh = h // group
        q = x_ref[i, pl.ds(kh * dk, dk)].astype(jnp.float32)
        k = x_ref[i, pl.ds(hk * dk + kh * dk, dk)].astype(jnp.float32)
        v = x_ref[i, pl.ds(2 * hk * dk + h * dv, dv)].astype(jnp.float32)
        beta = jax.nn.sigmoid(x_ref[i, h].astype(jnp.float32))
        decay = jnp.exp(-jax.nn.softplus(x_ref[i, hk + h].astype(jnp.float32)))
        state = cur * decay
        delta = (v - jnp.sum(k[:, None] * state, axis=0)) * beta
        state = state + k[:, None] * delta[None, :]
        o_ref[i, h, :] = jnp.sum(q[:, None] * state, axis=0).astype(o_ref.dtype)
        s_ref[slot, h] = state
        cur = nxt


def _pipe_kernel(slot_ref, x_ref, s_in_ref, o_ref, s_ref, *, n: int, hk: int, hv: int, dk: int, dv: int, bv: int,
                 rule: bool):
    """n consecutive (value head, block of bv value columns) items of one sequence, each item's state load issued
    before the previous item's work and store. The rule's two reductions are both over the old state (o = decay
    q S + (q . k) delta), so they do not wait for the update."""
    del s_in_ref
    p = pl.program_id(0)
    per_seq = hv * (dv // bv) // n
    i, base = p // per_seq, (p % per_seq) * n
    slot = slot_ref[i]
    group = hv // hk

    def at(j):
        h, vb = divmod(base + j, dv // bv)
        return h, pl.ds(vb * bv, bv)

    h, cols = at(0)
    cur = s_ref[slot, h, :, cols]
    for j in range(n):
        h, cols = at(j)
        nxt = None
        if j + 1 < n:
            h1, cols1 = at(j + 1)
            nxt = s_ref[slot, h1, :, cols1]
        if rule:
            kh = h // group
            q = x_ref[i, pl.ds(kh * dk, dk)].astype(jnp.float32)
            k = x_ref[i, pl.ds(hk * dk + kh * dk, dk)].astype(jnp.float32)
            v = x_ref[i, pl.ds(2 * hk * dk + h * dv + (base + j) % (dv // bv) * bv, bv)].astype(jnp.float32)
            beta = jax.nn.sigmoid(x_ref[i, h].astype(jnp.float32))
            decay = jnp.exp(-jax.nn.softplus(x_ref[i, hk + h].astype(jnp.float32)))
            ks = jnp.sum(k[:, None] * cur, axis=0)
            qs = jnp.sum(q[:, None] * cur, axis=0)
            delta = (v - decay * ks) * beta
            o_ref[i, h, cols] = (decay * qs + jnp.sum(q * k) * delta).astype(o_ref.dtype)
            s_ref[slot, h, :, cols] = cur * decay + k[:, None] * delta[None, :]
        else:
            s_ref[slot, h, :, cols] = cur * x_ref[i, h].astype(jnp.float32)
        cur = nxt


def _copy_out_kernel(slot_ref, x_ref, s_in_ref, s_ref):
    i, h = pl.program_id(0), pl.program_id(1)
    slot = slot_ref[i]
    s_ref[slot, h] = s_in_ref[slot, h] * x_ref[i, h].astype(jnp.float32)


def _rule_kernel(slot_ref, x_ref, s_in_ref, o_ref, s_ref, *, hk: int, group: int, dk: int, dv: int, bv: int):
    del s_in_ref
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slot_ref[i]
    cols = pl.ds(j * bv, bv)
    state = s_ref[slot, h, :, cols]
    kh = h // group
    q = x_ref[i, pl.ds(kh * dk, dk)].astype(jnp.float32)
    k = x_ref[i, pl.ds(hk * dk + kh * dk, dk)].astype(jnp.float32)
    v = x_ref[i, pl.ds(2 * hk * dk + h * dv + j * bv, bv)].astype(jnp.float32)
    beta = jax.nn.sigmoid(x_ref[i, h].astype(jnp.float32))
    decay = jnp.exp(-jax.nn.softplus(x_ref[i, hk + h].astype(jnp.float32)))
    state = state * decay
    delta = (v - jnp.sum(k[:, None] * state, axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    o_ref[i, h, cols] = jnp.sum(q[:, None] * state, axis=0).astype(o_ref.dtype)
    s_ref[slot, h, :, cols] = state


@functools.partial(jax.jit, static_argnames=("kind", "hk", "dk", "dv", "bv", "num_warps", "n"),
                   donate_argnames=("states",))
def probe(x, states, slots, *, kind: str, hk: int, dk: int, dv: int, bv: int, num_warps: int, n: int = 1):
    B = x.shape[0]
    hv = states.shape[1]
    whole = pl.no_block_spec
    params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
    grid = (B, hv, dv // bv)
    interpret = jax.default_backend() != "gpu"
    out = jax.ShapeDtypeStruct(states.shape, jnp.float32)
    none = jnp.zeros((B, hv, dv), x.dtype)
    if kind in ("copy_pipe", "copy_pipe_evict"):
        kernel = functools.partial(_copy_pipe_kernel, n=n, hv=hv, evict=kind.endswith("evict"))
        states = pl.pallas_call(kernel, grid=(B * hv // n,), in_specs=[whole] * 3, out_specs=whole, out_shape=out,
                                input_output_aliases={2: 0}, compiler_params=params, name="probe_copy_pipe",
                                interpret=interpret)(slots, x, states)
        return none, states
    if kind == "rule_pipe":
        kernel = functools.partial(_rule_pipe_kernel, n=n, hk=hk, hv=hv, dk=dk, dv=dv)
        return pl.pallas_call(kernel, grid=(B * hv // n,), in_specs=[whole] * 3, out_specs=[whole] * 2,
                              out_shape=[jax.ShapeDtypeStruct((B, hv, dv), x.dtype), out],
                              input_output_aliases={2: 1}, compiler_params=params, name="probe_rule_pipe",
                              interpret=interpret)(slots, x, states)
    if kind in ("pipe_copy", "pipe_rule"):
        kernel = functools.partial(_pipe_kernel, n=n, hk=hk, hv=hv, dk=dk, dv=dv, bv=bv, rule=kind == "pipe_rule")
        return pl.pallas_call(kernel, grid=(B * hv * (dv // bv) // n,), in_specs=[whole] * 3, out_specs=[whole] * 2,
                              out_shape=[jax.ShapeDtypeStruct((B, hv, dv), x.dtype), out],
                              input_output_aliases={2: 1}, compiler_params=params, name="probe_" + kind,
                              interpret=interpret)(slots, x, states)
    if kind == "copy_out":  # a fresh output buffer, not in place
        states = pl.pallas_call(_copy_out_kernel, grid=(B, hv), in_specs=[whole] * 3, out_specs=whole,
                                out_shape=out, compiler_params=params, name="probe_copy_out",
                                interpret=interpret)(slots, x, states)
        return none, states
    if kind == "copy":
        states = pl.pallas_call(functools.partial(_copy_kernel, bv=bv), grid=grid, in_specs=[whole] * 3,
                                out_specs=whole, out_shape=jax.ShapeDtypeStruct(states.shape, jnp.float32),
                                input_output_aliases={2: 0}, compiler_params=params, name="probe_copy",
                                interpret=jax.default_backend() != "gpu",
                                )(slots, x, states)
        return jnp.zeros((B, hv, dv), x.dtype), states
    kernel = functools.partial(_rule_kernel, hk=hk, group=hv // hk, dk=dk, dv=dv, bv=bv)
    o, states = pl.pallas_call(kernel, grid=grid, in_specs=[whole] * 3, out_specs=[whole] * 2,
                               out_shape=[jax.ShapeDtypeStruct((B, hv, dv), x.dtype),
                                          jax.ShapeDtypeStruct(states.shape, jnp.float32)],
                               input_output_aliases={2: 1}, compiler_params=params, name="probe_rule",
                               interpret=jax.default_backend() != "gpu",
                               )(slots, x, states)
    return o, states


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kinds", nargs="*", default=["base", "torch"],
                    help="base (copy, rule, fused), copies (pipelined copies), pipe (pipelined blocks), torch, "
                         "fused_ab")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    hk, hv, dk, dv, taps = 16, 32, 128, 128, 4
    if jax.default_backend() != "gpu":  # a check that it runs: the interpreter, one small batch
        args.batches, args.reps, args.kinds, args.rounds = [1], 1, ["base", "fused_ab"], 2
    C, vs = 2 * hk * dk + hv * dv, hv * dv
    rng = np.random.default_rng(0)
    dev = jax.devices()[0].device_kind
    commit = os.environ.get("JINFER_COMMIT")

    def timer(step, conv, states):
        """A function timing one run of `reps` chained steps (compiled here)."""
        def loop(c, s):
            acc = jnp.zeros((), jnp.float32)
            for _ in range(args.reps):
                c, s, o = step(c, s)
                acc = acc + o[0, 0, 0]
            return c, s, acc

        loop = jax.jit(loop, donate_argnums=(0, 1))
        pools = list(loop(conv, states)[:2])
        jax.block_until_ready(pools)

        def run():
            t0 = time.perf_counter()
            out = loop(*pools)
            pools[:] = out[:2]
            jax.block_until_ready(out)
            return (time.perf_counter() - t0) / args.reps
        return run

    def timed(step, conv, states):
        """The best of three timed runs (seconds per step)."""
        run = timer(step, conv, states)
        return min(run() for _ in range(3))

    def batch(B: int) -> None:
        proj = jnp.asarray(rng.standard_normal((B, C + vs + 2 * hv)) * 0.1, jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((C, 1, taps)) * 0.3, jnp.bfloat16)
        a_log, dt_bias = jnp.zeros(hv, jnp.float32), jnp.ones(hv, jnp.float32)
        norm_w = jnp.asarray(rng.standard_normal(dv), jnp.bfloat16)
        slots, fresh = jnp.arange(1, B + 1, dtype=jnp.int32), jnp.zeros(B, bool)
        positions = jnp.full((B,), 1000, jnp.int32)
        pools = lambda: (jnp.zeros((B + 1, taps, C), jnp.bfloat16),  # noqa: E731
                         jnp.zeros((B + 1, hv, dk, dv), jnp.float32))
        state_bytes = 2 * B * hv * dk * dv * 4
        row = {"device": dev, "commit": commit, "batch": B, "state_bytes": state_bytes}

        def report(name, t, **kw):
            print(json.dumps(row | {"path": name, **kw, "time_us": t * 1e6, "tb_per_s": state_bytes / t / 1e12}))

        variants = []
        if "copies" in args.kinds:
            variants = [("copy_out", 1, 4, dv)] + [
                (k, n, w, dv) for k in ("copy_pipe", "copy_pipe_evict", "rule_pipe") for n in (2, 4, 8) for w in (4, 8)]
        if "pipe" in args.kinds:
            variants = [(k, n, w, bv) for k in ("pipe_copy", "pipe_rule") for bv in (128, 64, 32)
                        for n in (2, 4, 8) for w in ((4, 8) if bv == 128 else (2, 4))]
        for kind, n, warps, bv in variants:
            def step(c, s, kind=kind, n=n, warps=warps, bv=bv):
                o, s = probe(proj, s, slots, kind=kind, hk=hk, dk=dk, dv=dv, bv=bv, num_warps=warps, n=n)
                return c, s, o
            try:
                report(kind, timed(step, *pools()), n=n, num_warps=warps, block_v=bv)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(row | {"path": kind, "n": n, "num_warps": warps, "block_v": bv,
                                        "error": str(e)[:300]}))
        if "torch" in args.kinds:
            import torch
            t = torch.zeros(state_bytes // 8, dtype=torch.float32, device="cuda")
            t2 = torch.empty_like(t)
            for name, fn in (("torch copy_", lambda: t2.copy_(t)), ("torch mul_ (in place)", lambda: t.mul_(1.0))):
                fn()
                torch.cuda.synchronize()
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(args.reps):
                        fn()
                    torch.cuda.synchronize()
                    best = min(best, (time.perf_counter() - t0) / args.reps)
                report(name, best)
            del t, t2
        if "fused_ab" in args.kinds:  # the fused kernel's options, compiled once, timed in interleaved rounds
            loops = {}
            for bv in (128, 64, 32):
                def fused(c, s, bv=bv):
                    o, c, s = fused_decode_step(proj, c, w, a_log, dt_bias, s, slots, positions, fresh,
                                                num_k_heads=hk, key_dim=dk, value_dim=dv, b_col=C + vs,
                                                a_col=C + vs + hv, z_col=C, norm_weight=norm_w, block_v=bv,
                                                interpret=jax.default_backend() != "gpu")
                    return c, s, o
                loops[bv] = timer(fused, *pools())
            times = {key: [] for key in loops}
            for _ in range(args.rounds):
                for key, run in loops.items():
                    times[key].append(run())
            for bv, ts in times.items():
                report("fused + gated norm", min(ts), block_v=bv,
                       median_us=float(np.median(ts)) * 1e6, rounds=len(ts))
        if "base" not in args.kinds:
            return
        for kind in ("copy", "rule"):
            for bv in (128, 64, 32):
                for warps in (4, 8) if bv == 128 else (2, 4):
                    def step(c, s, kind=kind, bv=bv, warps=warps):
                        o, s = probe(proj, s, slots, kind=kind, hk=hk, dk=dk, dv=dv, bv=bv, num_warps=warps)
                        return c, s, o
                    try:
                        report(kind, timed(step, *pools()), block_v=bv, num_warps=warps)
                    except Exception as e:  # noqa: BLE001 (a variant that does not compile is reported)
                        print(json.dumps(row | {"path": kind, "block_v": bv, "num_warps": warps,
                                                "error": str(e)[:300]}))
        for norm in (True, False):
            def fused(c, s, norm=norm):
                kw = dict(z_col=C, norm_weight=norm_w) if norm else {}
                o, c, s = fused_decode_step(proj, c, w, a_log, dt_bias, s, slots, positions, fresh, num_k_heads=hk,
                                            key_dim=dk, value_dim=dv, b_col=C + vs, a_col=C + vs + hv,
                                            interpret=jax.default_backend() != "gpu", **kw)
                return c, s, o
            report("fused" + (" + gated norm" if norm else ""), timed(fused, *pools()), num_warps=4)


    for B in args.batches:
        batch(B)

if __name__ == "__main__":
    main()
