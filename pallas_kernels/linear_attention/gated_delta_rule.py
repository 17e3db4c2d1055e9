"""Gated delta rule (Gated DeltaNet's linear attention) over a ragged batch of sequences.

Per value head, with S the [key_dim, value_dim] state and k, q L2-normalised (q also by key_dim^-0.5):

    S <- exp(g_t) * S                     (decay)
    S <- S + k_t (beta_t (v_t - k_t^T S))  (delta rule: write the correction of what S predicts for k_t)
    o_t = q_t^T S

Layout (ragged, like jinfer/models/batch.py): tokens of sequence b are rows
`query_start[b]:query_start[b + 1]` of q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g and beta [T, Hv]
(float32); each q/k head serves Hv / Hk consecutive value heads (HF's repeat_interleave). Every
sequence starts from its state slot `states[slots[b]]` ([S, Hv, Dk, Dv] float32), or from zeros where
`fresh[b]` (its first token is position 0), and its final state is written back to the same slot.
Rows past `query_start[B]` are padding.

The kernel (`recurrent_gated_delta_rule`, Pallas Triton lowering) is flash-linear-attention's fused
recurrent form, varlen: one program per (sequence, value head, block of value columns) keeps its
[Dk, block_v] slice of the state in registers, walks its sequence's rows (L2-normalising q and k,
decaying, writing the delta, reading the output) and writes the slice back to the sequence's slot in
place (the pool is aliased to the output). A decode step is one row per program: the fused recurrent
decode step. It would walk a long prefill's rows one by one, parallel only over sequences x heads x
blocks: `gated_delta_rule(backend="pallas")` gives sequences of >= 64 new rows to the chunked (WY) form
(gated_delta_rule_chunked.py, tensor-core matmuls) and skips them here (`active`).
`recurrent_reference` (token by token, exactly HF's `torch_recurrent_gated_delta_rule`) is the
reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

L2_EPS = 1e-6  # HF / flash-linear-attention's l2norm epsilon


def check_shapes(q, k, v, g, beta, states, *, min_dim: int = 1) -> tuple[int, int, int]:
    """The kernels' argument checks (ValueError naming what is wrong); returns (Hv, Dk, Dv)."""
    T, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, hv) or beta.shape != (T, hv):
        raise ValueError(f"q/k must be [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv]: {q.shape=} {k.shape=} "
                         f"{v.shape=} {g.shape=} {beta.shape=}")
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of q/k heads ({hk})")
    if states.shape[1:] != (hv, dk, dv) or states.dtype != jnp.float32:
        raise ValueError(f"states must be float32 [slots, {hv}, {dk}, {dv}], got {states.shape} {states.dtype}")
    if dk & (dk - 1) or dv & (dv - 1) or min(dk, dv) < min_dim:
        raise ValueError(f"key_dim={dk} and value_dim={dv} must be powers of two >= {min_dim}")
    return hv, dk, dv


def l2norm(x: jax.Array) -> jax.Array:
    """x / sqrt(sum x^2 + eps) over the last axis (float32), as HF's `l2norm`."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def token_sequences(query_start: jax.Array, num_tokens: int) -> jax.Array:
    """[T] the sequence of each row; B (one past the last) for padding rows."""
    return jnp.searchsorted(query_start[1:], jnp.arange(num_tokens, dtype=jnp.int32), side="right").astype(jnp.int32)


def head_views(q, k, v, packed_k_heads: int | None):
    """q / k / v as the kernels take them, and the head offsets each reads at: as given (offsets 0); or, with
    packed_k_heads = Hk, q is one [T, 2 Hk + Hv, D] array holding the q heads, then the k heads, then the v heads
    (Gated DeltaNet's conv output reshaped for free when Dk = Dv) and k, v are None: the one array is passed as
    all three operands, so no slice of it is copied out before the kernel."""
    if packed_k_heads is None:
        return (q, k, v), (0, 0, 0)
    _check_packed(q, k, v, packed_k_heads)
    hk = packed_k_heads
    return (q, q, q), (0, hk, 2 * hk)


def _check_packed(q, k, v, hk: int) -> None:
    if k is not None or v is not None or len(q.shape) != 3 or q.shape[1] <= 2 * hk:
        raise ValueError(f"packed q|k|v: q must be [T, 2 Hk + Hv, D] with Hk = {hk} heads of q and k first, and "
                         f"k = v = None; got q {q.shape}, k {None if k is None else k.shape}")


def head_shapes(q, k, v, packed_k_heads: int | None):
    """The shapes of q, k, v ([T, Hk, Dk], [T, Hk, Dk], [T, Hv, Dv]) whether packed (`head_views`) or not."""
    if packed_k_heads is None:
        return q, k, v
    _check_packed(q, k, v, packed_k_heads)
    (T, H, D), hk = q.shape, packed_k_heads
    return (jax.ShapeDtypeStruct((T, hk, D), q.dtype), jax.ShapeDtypeStruct((T, hk, D), q.dtype),
            jax.ShapeDtypeStruct((T, H - 2 * hk, D), q.dtype))


def unpack_heads(q, k, v, packed_k_heads: int | None):
    """q, k, v as three arrays (slices of a packed one: copies; for the jnp references)."""
    if packed_k_heads is None:
        return q, k, v
    hk = packed_k_heads
    return q[:, :hk], q[:, hk:2 * hk], q[:, 2 * hk:]


def prepare_qk(q: jax.Array, k: jax.Array, num_v_heads: int) -> tuple[jax.Array, jax.Array]:
    """L2-normalise q and k (float32), scale q by key_dim^-0.5, repeat each head for its value heads."""
    rep = num_v_heads // q.shape[1]
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    return jnp.repeat(q, rep, axis=1), jnp.repeat(k, rep, axis=1)  # [T, Hv, Dk] each


def initial_states(states: jax.Array, slots: jax.Array, fresh: jax.Array) -> jax.Array:
    """[B, Hv, Dk, Dv]: each sequence's slot, zeros for sequences starting at position 0."""
    return jnp.where(fresh[:, None, None, None], 0.0, states[slots])


def recurrent_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                        states: jax.Array, slots: jax.Array, fresh: jax.Array, query_start: jax.Array
                        ) -> tuple[jax.Array, jax.Array]:
    """The rule token by token (a `lax.scan` over the T rows) in float32. Returns (o [T, Hv, Dv] float32,
    the updated states pool)."""
    T, B = q.shape[0], slots.shape[0]
    qh, kh = prepare_qk(q, k, v.shape[1])
    seq = token_sequences(query_start, T)
    first = jnp.arange(T) == query_start[jnp.minimum(seq, B)]  # the first row of its sequence (padding: any)
    init = initial_states(states, slots, fresh)
    init = jnp.concatenate([init, jnp.zeros_like(init[:1])])  # row B: the padding rows' scratch state
    finals = init

    def step(carry, xs):
        s, finals = carry
        q_t, k_t, v_t, g_t, b_t, seq_t, first_t = xs
        s = jnp.where(first_t, init[seq_t], s)  # [Hv, Dk, Dv]
        s = s * jnp.exp(g_t)[:, None, None]
        kv_mem = jnp.einsum("hk,hkv->hv", k_t, s)
        delta = (v_t - kv_mem) * b_t[:, None]
        s = s + k_t[:, :, None] * delta[:, None, :]
        o_t = jnp.einsum("hk,hkv->hv", q_t, s)
        finals = jax.lax.dynamic_update_index_in_dim(finals, s, seq_t, 0)  # the last row of a sequence wins
        return (s, finals), o_t

    xs = (qh, kh, v.astype(jnp.float32), g.astype(jnp.float32), beta.astype(jnp.float32), seq, first)
    (_, finals), o = jax.lax.scan(step, (init[0], finals), xs)
    return o, states.at[slots].set(finals[:B])


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _recurrent_kernel(qs_ref, slot_ref, fresh_ref, active_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_in_ref,
                      o_in_ref, o_ref, s_ref, *, group: int, block_v: int, offsets: tuple[int, int, int]):
    # qs_ref [B + 1]: row ranges; slot_ref, fresh_ref, active_ref [B]; q_ref, k_ref [T, Hk, Dk]; v_ref [T, Hv, Dv]
    # (or one packed array: heads read at `offsets`, see head_views);
    # g_ref, beta_ref [T, Hv] f32; s_in_ref / s_ref [S, Hv, Dk, Dv] f32: the pool, aliased (read, then
    # written in place); o_in_ref / o_ref [T, Hv, Dv]: the output, aliased (only this kernel's rows written).
    del s_in_ref, o_in_ref  # the same buffers as s_ref, o_ref
    # the grid is (Dv / block_v, Hv, B): consecutive programs share a sequence's head, then its next heads
    # (adjacent state in its slot), as the decode kernel (gated_delta_rule_decode.py)
    j, h, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kh = h // group
    dk = q_ref.shape[-1]
    cols = pl.ds(j * block_v, block_v)
    start, end = qs_ref[b], qs_ref[b + 1]
    scale = dk ** -0.5

    def body(t, state):
        q = q_ref[t, offsets[0] + kh, :].astype(jnp.float32)  # [Dk]
        k = k_ref[t, offsets[1] + kh, :].astype(jnp.float32)
        q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * scale
        k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
        v = v_ref[t, offsets[2] + h, cols].astype(jnp.float32)  # [block_v]
        decay = jnp.exp(g_ref[t, h])
        # both reductions over the old state (o = q . S_new = decay q . S + (q . k) delta): neither waits on the
        # update
        ks = jnp.sum(k[:, None] * state, axis=0)
        qs = jnp.sum(q[:, None] * state, axis=0)
        delta = (v - decay * ks) * beta_ref[t, h]  # [block_v]
        o_ref[t, h, cols] = (decay * qs + jnp.sum(q * k) * delta).astype(o_ref.dtype)
        return state * decay + k[:, None] * delta[None, :]

    @pl.when(active_ref[b] != 0)  # inactive: left to the chunked kernel (its rows and slot not touched)
    def _():
        slot = slot_ref[b]
        live = fresh_ref[b] == 0  # a fresh sequence starts from zeros: its slot is not read
        state = plgpu.load(s_ref.at[slot, h, :, cols], mask=jnp.broadcast_to(live, (dk, block_v)), other=0.0)
        s_ref[slot, h, :, cols] = jax.lax.fori_loop(start, end, body, state)


def _recurrent_call(q, k, v, g, beta, states, slots, fresh, query_start, active, out, *, hk, block_v, num_warps,
                    offsets, interpret):
    T, hv, dv = out.shape
    B = slots.shape[0]
    whole = pl.no_block_spec
    kernel = functools.partial(_recurrent_kernel, group=hv // hk, block_v=block_v, offsets=offsets)
    o, states = pl.pallas_call(
        kernel,
        grid=(dv // block_v, hv, B),
        in_specs=[whole] * 11,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(states.shape, jnp.float32)],
        input_output_aliases={10: 0, 9: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"recurrent_gated_delta_rule_bv{block_v}",
    )(query_start.astype(jnp.int32), slots.astype(jnp.int32), fresh.astype(jnp.int32), active.astype(jnp.int32),
      q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), states, out)
    return o, states


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "packed_k_heads", "interpret"),
                   donate_argnames=("states", "out"))
def recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, active=None, out=None, *,
                               block_v: int | None = None, num_warps: int = 4, packed_k_heads: int | None = None,
                               interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The rule over a ragged batch (module doc), updating the state pool in place (donated).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (or q|k|v packed in q, k = v = None: `head_views`); g, beta: [T, Hv];
    states: [S, Hv, Dk, Dv] float32; slots, fresh: [B]; query_start: [B + 1]; active: [B] bool or None (all):
    the sequences to run (the others' rows and slots are not touched: the chunked kernel runs them); out:
    [T, Hv, Dv] or None (zeros, float32): the output buffer (donated), of which only the active sequences'
    rows are written, in its dtype (so two kernels fill one buffer, each its own rows). Returns (o, the
    pool). Dk and Dv powers of two.
    """
    shapes = head_shapes(q, k, v, packed_k_heads)
    hv, dk, dv = check_shapes(*shapes, g, beta, states)
    # 64 columns: decode-sized work at 256 sequences 438 vs 461 us with 32 (H100, gdn_kernels_h100_d3496cc.json)
    block_v = block_v or min(dv, 64)
    if dv % block_v:
        raise ValueError(f"block_v={block_v} must divide value_dim={dv}")
    if active is None:
        active = jnp.ones(slots.shape, bool)
    out = check_out(out, q.shape[0], hv, dv)
    (q, k, v), offsets = head_views(q, k, v, packed_k_heads)
    return _recurrent_call(q, k, v, g, beta, states, slots, fresh, query_start, active, out, hk=shapes[0].shape[1],
                           block_v=block_v, num_warps=num_warps, offsets=offsets, interpret=interpret)


def check_out(out, T: int, hv: int, dv: int) -> jax.Array:
    """The output buffer the kernels write their rows into: zeros (float32) when None."""
    if out is None:
        return jnp.zeros((T, hv, dv), jnp.float32)
    if out.shape != (T, hv, dv):
        raise ValueError(f"out must be [T, Hv, Dv] = {(T, hv, dv)}, got {out.shape}")
    return out


def gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, *, backend: str = "reference",
                     interpret: bool = False, chunked: bool = True, out_dtype=jnp.float32,
                     packed_k_heads: int | None = None) -> tuple[jax.Array, jax.Array]:
    """The rule over a ragged batch (see the module doc): (o [T, Hv, Dv] in out_dtype, updated states pool).

    backend "reference": `recurrent_reference`. "pallas": sequences with >= MIN_LEN (64) new rows run in
    chunks (linear_attention/gated_delta_rule_chunked.py: tensor-core matmuls), the others (decode rows, short
    chunks of a chunked prefill) in the recurrent kernel; a step of fewer than MIN_LEN rows only launches
    the recurrent one. Each kernel skips the other's sequences and writes its own rows of one zeroed output
    buffer (in out_dtype: no float32 copy of o goes through HBM), so a mixed step costs both their work only.
    chunked=False (decode-only steps, where no sequence can be long): the recurrent kernel alone, without
    the chunked part's dozen or so small ops per layer. packed_k_heads: q holds q|k|v (`head_views`).
    """
    if backend != "pallas":
        o, states = recurrent_reference(*unpack_heads(q, k, v, packed_k_heads), g, beta, states, slots, fresh,
                                        query_start)
        return o.astype(out_dtype), states
    from pallas_kernels.linear_attention.gated_delta_rule_chunked import MIN_LEN, chunked_gated_delta_rule

    hv, dv = head_shapes(q, k, v, packed_k_heads)[2].shape[1:]
    out = jnp.zeros((q.shape[0], hv, dv), out_dtype)
    pk = dict(packed_k_heads=packed_k_heads, interpret=interpret)
    if not chunked or q.shape[0] < MIN_LEN:
        return recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, out=out, **pk)
    short = query_start[1:] - query_start[:-1] < MIN_LEN
    out, states = recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, short, out, **pk)
    return chunked_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, out=out, min_len=MIN_LEN,
                                    **pk)


# ----------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------
def main():
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
