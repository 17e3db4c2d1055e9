"""Gated DeltaNet's decode step in one kernel: the short causal conv's update, SiLU, the gates and the delta
rule, for steps where every sequence has exactly one new row (row b is sequence b's).

The general path (jinfer/models/qwen3_5.py) runs the conv over a ragged batch in XLA (gathers of each row's
K - 1 predecessors, the conv state's update as a scatter), splits q | k | v, computes beta = sigmoid(b) and
g = -exp(A_log) softplus(a + dt_bias), then the recurrent kernel (gated_delta_rule.py): about ten small
kernels per layer, ~10 us of a decode step's time per layer on an H100, for a few hundred kB. Here one
program per (sequence, value head, block of value columns), reading q | k | v, b and a straight from the
layer's input projection (slices of it were copies) and writing o in the activation dtype:

- reads its q and k channels' conv window (the sequence's K - 1 stored inputs and this row's; zeros where
  the sequence is fresh) and its block of v channels', applies the depthwise conv and SiLU (rounded to the
  activation dtype, as the general path stores them), L2-normalises q and k;
- computes the head's beta and g, and runs the rule on its [Dk, block_v] state slice in registers, writing
  the slice back to the sequence's slot in place (as the recurrent kernel);
- shifts the conv window: each program writes its own v columns' K - 1 newest inputs in place; q and k
  channels are shared by the programs of a key head, so the first of them writes those to a separate
  [B, K - 1, 2 Hk Dk] output, which `fused_decode_step` scatters into the slots afterwards (writing them in
  place would race with the other programs still reading the old window).

Padding rows (past the real sequences) read and write slot 0, the reserved one. `decode_reference` is the
same step in plain jnp (the general path's formulas restricted to one row per sequence), golden-checked
against HF through the model.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gated_delta_rule import L2_EPS, recurrent_reference


def gates(b: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)), float32 [T, Hv]. beta is rounded to b's dtype,
    as HF computes it (`b.sigmoid()` in the activation dtype); g in float32, as HF."""
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype).astype(jnp.float32)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return beta, g


def decode_reference(proj, conv_state, conv_w, a_log, dt_bias, states, slots, fresh, *, num_k_heads: int,
                     key_dim: int, value_dim: int, b_col: int, a_col: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """proj: [B, W] the layer's input projection: columns [0, C) this step's q | k | v inputs before the conv
    (C = 2 Hk Dk + Hv Dv), [b_col, b_col + Hv) b and [a_col, a_col + Hv) a; conv_state: [S, K-1, C] (oldest
    first); conv_w: [C, 1, K]; a_log, dt_bias: [Hv]; states: [S, Hv, Dk, Dv] float32; slots, fresh: [B].
    Returns (o [B, Hv, Dv] in proj's dtype, conv_state, states)."""
    B = proj.shape[0]
    C = conv_w.shape[0]
    hk, dk, dv, hv = num_k_heads, key_dim, value_dim, a_log.shape[0]
    mixed, b, a = proj[:, :C], proj[:, b_col:b_col + hv], proj[:, a_col:a_col + hv]
    prev = jnp.where(fresh[:, None, None], 0, conv_state[slots]).astype(mixed.dtype)  # [B, K-1, C]
    window = jnp.concatenate([prev, mixed[:, None, :]], axis=1)  # [B, K, C]
    w = conv_w[:, 0, :].astype(jnp.float32)  # [C, K]
    y = jax.nn.silu(jnp.einsum("bkc,ck->bc", window.astype(jnp.float32), w)).astype(mixed.dtype)
    q = y[:, :hk * dk].reshape(B, hk, dk)
    k = y[:, hk * dk:2 * hk * dk].reshape(B, hk, dk)
    v = y[:, 2 * hk * dk:].reshape(B, hv, dv)
    beta, g = gates(b, a, a_log, dt_bias)
    qs = jnp.arange(B + 1, dtype=jnp.int32)
    o, states = recurrent_reference(q, k, v, g, beta, states, slots, fresh, qs)
    return o.astype(proj.dtype), conv_state.at[slots].set(window[:, 1:].astype(conv_state.dtype)), states


def _decode_kernel(slot_ref, fresh_ref, x_ref, cs_in_ref, w_ref, alog_ref, dtb_ref, s_in_ref,
                   o_ref, cs_ref, s_ref, qk_ref, *, hk: int, group: int, dk: int, block_v: int, taps: int, b_col: int,
                   a_col: int):
    # x_ref [B, W] the projection (q | k | v before the conv at [0, C), b at b_col, a at a_col: read in place, no
    # slices); cs_ref [S, K-1, C] the conv pool (aliased
    # with cs_in_ref); w_ref [C, K]; alog_ref, dtb_ref [Hv]; s_ref [S, Hv, Dk, Dv] f32 (aliased with s_in_ref);
    # o_ref [B, Hv, Dv] f32; qk_ref [B, K-1, 2 Hk Dk]: the q | k channels' new window.
    del cs_in_ref, s_in_ref
    i, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // group
    slot = slot_ref[i]
    fresh = fresh_ref[i] != 0  # a fresh sequence's window and state start at zero (never what its slot holds)

    def conv(offset: int | jax.Array, n: int):
        """This row's conv output for channels [offset, offset + n) and the window's K - 1 newest inputs."""
        cols = pl.ds(offset, n)
        rows = [jnp.where(fresh, 0.0, cs_ref[slot, r, cols].astype(jnp.float32)) for r in range(taps - 1)]
        rows.append(x_ref[i, cols].astype(jnp.float32))
        acc = rows[0] * w_ref[cols, 0].astype(jnp.float32)
        for r in range(1, taps):
            acc = acc + rows[r] * w_ref[cols, r].astype(jnp.float32)
        y = (acc * jax.nn.sigmoid(acc)).astype(x_ref.dtype).astype(jnp.float32)  # SiLU, rounded as stored
        return y, rows[1:]

    q, q_win = conv(kh * dk, dk)
    k, k_win = conv(hk * dk + kh * dk, dk)
    v_off = 2 * hk * dk + h * (s_ref.shape[-1]) + j * block_v
    v, v_win = conv(v_off, block_v)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * dk ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    beta = jax.nn.sigmoid(x_ref[i, b_col + h].astype(jnp.float32)).astype(x_ref.dtype).astype(jnp.float32)
    a = x_ref[i, a_col + h].astype(jnp.float32) + dtb_ref[h].astype(jnp.float32)
    softplus = jnp.maximum(a, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(a)))
    decay = jnp.exp(-jnp.exp(alog_ref[h].astype(jnp.float32)) * softplus)

    cols = pl.ds(j * block_v, block_v)
    state = jnp.where(fresh, 0.0, s_ref[slot, h, :, cols])  # [Dk, block_v]
    state = state * decay
    delta = (v - jnp.sum(k[:, None] * state, axis=0)) * beta
    state = state + k[:, None] * delta[None, :]
    o_ref[i, h, cols] = jnp.sum(q[:, None] * state, axis=0).astype(o_ref.dtype)
    s_ref[slot, h, :, cols] = state
    for r in range(taps - 1):  # this program's own v columns: in place
        cs_ref[slot, r, pl.ds(v_off, block_v)] = v_win[r].astype(cs_ref.dtype)

    @pl.when((h % group == 0) & (j == 0))  # the key head's q and k channels: once, to the side output
    def _():
        for r in range(taps - 1):
            qk_ref[i, r, pl.ds(kh * dk, dk)] = q_win[r].astype(qk_ref.dtype)
            qk_ref[i, r, pl.ds(hk * dk + kh * dk, dk)] = k_win[r].astype(qk_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_k_heads", "key_dim", "value_dim", "b_col", "a_col", "block_v",
                                             "num_warps", "interpret"), donate_argnames=("conv_state", "states"))
def fused_decode_step(proj, conv_state, conv_w, a_log, dt_bias, states, slots, fresh, *, num_k_heads: int,
                      key_dim: int, value_dim: int, b_col: int, a_col: int, block_v: int | None = None,
                      num_warps: int = 4, interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_reference` in one kernel (module doc); the two pools are updated in place (donated).
    Dk and Dv powers of two >= 16 (block_v a power of two >= 8 dividing Dv, default min(Dv, 32))."""
    B, W = proj.shape
    C, _, taps = conv_w.shape
    hk, dk, dv, hv = num_k_heads, key_dim, value_dim, a_log.shape[0]
    if C != 2 * hk * dk + hv * dv or conv_state.shape[1:] != (taps - 1, C) or conv_w.shape[1] != 1 \
            or max(b_col, a_col) + hv > W or min(b_col, a_col) < C:
        raise ValueError(f"conv_w [C, 1, K] with C = 2 Hk Dk + Hv Dv, conv_state [S, K-1, C], b and a columns of "
                         f"proj past C: {proj.shape=} {conv_state.shape=} {conv_w.shape=} {b_col=} {a_col=} "
                         f"({hk=} {dk=} {hv=} {dv=})")
    if states.shape[1:] != (hv, dk, dv) or states.dtype != jnp.float32 or hv % hk:
        raise ValueError(f"states must be float32 [S, {hv}, {dk}, {dv}] with Hv a multiple of Hk: {states.shape}")
    if dk & (dk - 1) or dv & (dv - 1) or min(dk, dv) < 16 or taps < 2:
        raise ValueError(f"key_dim={dk} and value_dim={dv} must be powers of two >= 16, the conv >= 2 taps")
    block_v = block_v or min(dv, 32)
    if dv % block_v or block_v < 8 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two >= 8 dividing value_dim={dv}")
    whole = pl.no_block_spec
    kernel = functools.partial(_decode_kernel, hk=hk, group=hv // hk, dk=dk, block_v=block_v, taps=taps,
                               b_col=b_col, a_col=a_col)
    o, conv_state, states, qk = pl.pallas_call(
        kernel,
        grid=(B, hv, dv // block_v),
        in_specs=[whole] * 8,
        out_specs=[whole] * 4,
        out_shape=[jax.ShapeDtypeStruct((B, hv, dv), proj.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(states.shape, jnp.float32),
                   jax.ShapeDtypeStruct((B, taps - 1, 2 * hk * dk), conv_state.dtype)],
        input_output_aliases={3: 1, 7: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"gated_delta_decode_bv{block_v}",
    )(slots.astype(jnp.int32), fresh.astype(jnp.int32), proj, conv_state, conv_w[:, 0, :], a_log, dt_bias, states)
    conv_state = conv_state.at[slots, :, :2 * hk * dk].set(qk)
    return o, conv_state, states


# ----------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------
def main():
    """One Qwen3.5-4B linear layer's decode step (16 q/k heads, 32 v heads, 128 x 128 state, conv of 4 taps over
    8192 channels) at decode batches: the fused kernel (block_v, warps) against the general path (the conv in
    XLA, the recurrent kernel). Each figure times `--reps` steps chained in one executable (each step reads the
    pools the previous one wrote, as decode does), so no dispatch is timed. TB/s on the recurrent state's bytes
    (read + written), the issue's measure. JSON lines on stdout; tiny shapes on CPU (interpreter) to check it."""
    import argparse
    import json
    import os
    import time

    import numpy as np

    from jinfer.models.qwen3_5 import causal_conv
    from pallas_kernels.gated_delta_rule import recurrent_gated_delta_rule, token_sequences

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--block-v", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    hk, hv, dk, dv, taps = (16, 32, 128, 128, 4) if gpu else (2, 4, 16, 16, 4)
    if not gpu:
        args.batches, args.block_v, args.num_warps, args.reps = [2], [16], [4], 2
    C = 2 * hk * dk + hv * dv
    rng = np.random.default_rng(0)
    dev = jax.devices()[0].device_kind
    commit = os.environ.get("JINFER_COMMIT")  # the tree that ran (set by the GPU scripts' caller)

    def timed(step, conv, states):
        """Seconds per step: `reps` steps unrolled in one executable (an XLA while loop costs a host round trip
        per iteration, ~10 us); each reads the pools the previous one wrote, in place (donated)."""
        def loop(c, s):
            acc = jnp.zeros((), jnp.float32)
            for _ in range(args.reps):
                c, s, o = step(c, s)
                acc = acc + o[0, 0, 0]  # the output is used, but not copied
            return c, s, acc

        loop = jax.jit(loop, donate_argnums=(0, 1))
        conv, states, _ = loop(conv, states)  # compile
        jax.block_until_ready((conv, states))
        t0 = time.perf_counter()
        conv, states, acc = loop(conv, states)
        jax.block_until_ready((conv, states, acc))
        return (time.perf_counter() - t0) / args.reps

    def batch(B: int) -> None:
        proj = jnp.asarray(rng.standard_normal((B, C + 2 * hv)), jnp.bfloat16)  # mixed | b | a
        mixed, b, a = proj[:, :C], proj[:, C:C + hv], proj[:, C + hv:]
        w = jnp.asarray(rng.standard_normal((C, 1, taps)) * 0.3, jnp.bfloat16)
        a_log, dt_bias = jnp.zeros(hv, jnp.float32), jnp.ones(hv, jnp.float32)
        slots, fresh = jnp.arange(1, B + 1, dtype=jnp.int32), jnp.zeros(B, bool)
        qs = jnp.arange(B + 1, dtype=jnp.int32)
        pools = lambda: (jnp.zeros((B + 1, taps - 1, C), jnp.bfloat16),  # noqa: E731
                         jnp.zeros((B + 1, hv, dk, dv), jnp.float32))
        state_bytes = 2 * B * hv * dk * dv * 4
        row = {"device": dev, "commit": commit, "batch": B, "state_bytes": state_bytes}

        def general(conv, states):
            y, conv = causal_conv(mixed, conv, w, token_sequences(qs, B), qs[:-1], qs, slots, fresh)
            q, k, v = jnp.split(y, [hk * dk, 2 * hk * dk], axis=-1)
            beta, g = gates(b, a, a_log, dt_bias)
            o, states = recurrent_gated_delta_rule(q.reshape(B, hk, dk), k.reshape(B, hk, dk), v.reshape(B, hv, dv),
                                                   g, beta, states, slots, fresh, qs, interpret=not gpu)
            return conv, states, o

        t = timed(general, *pools())
        print(json.dumps(row | {"path": "general (XLA conv + recurrent kernel)", "time_us": t * 1e6,
                                "tb_per_s": state_bytes / t / 1e12}))
        for bv in args.block_v:
            for warps in args.num_warps:
                def fused(conv, states, bv=bv, warps=warps):
                    o, conv, states = fused_decode_step(proj, conv, w, a_log, dt_bias, states, slots, fresh,
                                                        num_k_heads=hk, key_dim=dk, value_dim=dv, b_col=C,
                                                        a_col=C + hv, block_v=bv, num_warps=warps, interpret=not gpu)
                    return conv, states, o

                t = timed(fused, *pools())
                print(json.dumps(row | {"path": "fused", "block_v": bv, "num_warps": warps, "time_us": t * 1e6,
                                        "tb_per_s": state_bytes / t / 1e12}))

    for B in args.batches:
        batch(B)

if __name__ == "__main__":
    main()
