"""Gated DeltaNet's decode step in one kernel: the short causal conv's update, SiLU, the gates, the delta rule
and the gated RMSNorm, for steps where every sequence has exactly one new row (row b is sequence b's).

The general path (jinfer/models/qwen3_5.py) runs the conv over a ragged batch in XLA (gathers of each row's
K - 1 predecessors, the conv state's update as a scatter), splits q | k | v, computes beta = sigmoid(b) and
g = -exp(A_log) softplus(a + dt_bias), then the recurrent kernel (gated_delta_rule.py) and the gated RMSNorm:
about ten small kernels per layer, ~10 us of a decode step's time per layer on an H100, for a few hundred kB.
Here one program per (value head, sequence) (a sequence's heads in consecutive programs), reading q | k | v, z,
b and a straight from the layer's input projection (slices of it were copies) and writing the normalised, gated o
in the activation dtype:

- loads its [Dk, Dv] state slice in blocks of value columns (the bulk of its bytes; not at all for a fresh
  sequence, whose state is zeros), its q and k channels' conv window (the sequence's K - 1 previous inputs
  from the conv ring, zeros before position 0, and this row's) and its v channels', the gates' inputs and z,
  all before any of them is used (ptxas schedules them: the order in the source, state first or last, measured
  the same); each block past the second is loaded before the previous block's work;
- applies the depthwise conv and SiLU (rounded to the activation dtype, as the general path stores them),
  L2-normalises q and k, computes the head's beta and g;
- runs the rule on each block in registers: both reductions over the old state (k S and q S; o = q S_new =
  decay q S + (q . k) delta, so o does not wait on the update), then the update, written back to the
  sequence's slot in place (as the recurrent kernel);
- applies the gated RMSNorm to the head's o (HF's RMSNormGated: the whole head is in the program);
- writes this row's inputs into the conv ring at row `position % K`: its own v channels, and the key head's
  q and k channels from the key head's first program. The ring (`[S, K, C]`, row r holding the input at the
  latest position = r mod K; see causal_conv.py) has one row more than the window, so the row written
  is never one that another program of the step still reads: no side output, no scatter afterwards.

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

from pallas_kernels.linear_attention.gated_delta_rule_common import L2_EPS, recurrent_reference
from pallas_kernels.linear_attention.gated_rms_norm import gated_rms_norm_reference


def gates(b: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)), float32 [T, Hv]. beta is rounded to b's dtype,
    as HF computes it (`b.sigmoid()` in the activation dtype); g in float32, as HF."""
    beta = jax.nn.sigmoid(b.astype(jnp.float32)).astype(b.dtype).astype(jnp.float32)
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return beta, g


def decode_reference(proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions, fresh, *,
                     num_k_heads: int, key_dim: int, value_dim: int, b_col: int, a_col: int,
                     z_col: int | None = None, norm_weight: jax.Array | None = None,
                     eps: float = 1e-6) -> tuple[jax.Array, jax.Array, jax.Array]:
    """proj: [B, W] the layer's input projection: columns [0, C) this step's q | k | v inputs before the conv
    (C = 2 Hk Dk + Hv Dv), [z_col, z_col + Hv Dv) the output gate z, [b_col, b_col + Hv) b and
    [a_col, a_col + Hv) a; conv_state: [S, K, C] the conv ring (row r: the input at the latest position = r
    mod K); conv_w: [C, 1, K]; a_log, dt_bias: [Hv]; states: [S, Hv, Dk, Dv] float32; slots, positions (each
    row's position in its sequence), fresh (the state starts at zero): [B]. With `norm_weight` ([Dv]) o is
    normalised and gated (HF's RMSNormGated with z). Returns (o [B, Hv, Dv] in proj's dtype, conv_state,
    states)."""
    B = proj.shape[0]
    C = conv_w.shape[0]
    hk, dk, dv, hv = num_k_heads, key_dim, value_dim, a_log.shape[0]
    mixed, b, a = proj[:, :C], proj[:, b_col:b_col + hv], proj[:, a_col:a_col + hv]
    y, conv_state = conv_step(mixed, conv_state, conv_w, slots, positions)
    q = y[:, :hk * dk].reshape(B, hk, dk)
    k = y[:, hk * dk:2 * hk * dk].reshape(B, hk, dk)
    v = y[:, 2 * hk * dk:].reshape(B, hv, dv)
    beta, g = gates(b, a, a_log, dt_bias)
    qs = jnp.arange(B + 1, dtype=jnp.int32)
    o, states = recurrent_reference(q, k, v, g, beta, states, slots, fresh, qs)
    o = o.astype(proj.dtype)
    if norm_weight is not None:
        o = gated_rms_norm_reference(o, proj[:, z_col:z_col + hv * dv].reshape(B, hv, dv), norm_weight, eps)
    return o, conv_state, states


def conv_step(mixed, conv_state, conv_w, slots, positions) -> tuple[jax.Array, jax.Array]:
    """The conv + SiLU of one new row per sequence (mixed [B, C], at `positions`) from its ring in the pool
    conv_state [S, K, C] (inputs before position 0 read as zeros); returns (y [B, C] in mixed's dtype, the pool
    with each row written to its ring at row position mod K)."""
    B = mixed.shape[0]
    K = conv_w.shape[-1]
    ring = conv_state[slots]  # [B, K, C]
    w = conv_w[:, 0, :].astype(jnp.float32)  # [C, K]
    acc = mixed.astype(jnp.float32) * w[:, K - 1]
    for d in range(1, K):  # tap d: the input d positions back
        p = positions - d
        prev = jnp.where((p >= 0)[:, None], ring[jnp.arange(B), p % K].astype(jnp.float32), 0.0)
        acc = acc + prev * w[:, K - 1 - d]
    y = jax.nn.silu(acc).astype(mixed.dtype)
    return y, conv_state.at[slots, positions % K].set(mixed.astype(conv_state.dtype))


def _decode_kernel(slot_ref, pos_ref, fresh_ref, x_ref, cs_in_ref, w_ref, alog_ref, dtb_ref, nw_ref, s_in_ref,
                   o_ref, cs_ref, s_ref, *, hk: int, group: int, dk: int, dv: int, bv: int, taps: int, b_col: int,
                   a_col: int, z_col: int | None, eps: float, evict: str | None):
    # x_ref [B, W] the projection (q | k | v before the conv at [0, C), z at z_col, b at b_col, a at a_col: read
    # in place, no slices); cs_ref [S, K, C] the conv ring (aliased with cs_in_ref); w_ref [C, K]; alog_ref,
    # dtb_ref [Hv]; nw_ref [Dv] the gated norm's weight (unused without z_col); s_ref [S, Hv, Dk, Dv] f32
    # (aliased with s_in_ref); o_ref [B, Hv, Dv].
    del cs_in_ref, s_in_ref
    # the grid is (Hv, B): consecutive programs take one sequence's consecutive heads, adjacent 64 KB states in
    # its slot and the same conv ring rows (batch 64: 113 vs 117 us, 256: 408 vs 429 us with (B, Hv);
    # gdn_decode_order_h100_f34832e.jsonl)
    h, i = pl.program_id(0), pl.program_id(1)
    kh = h // group
    nb = dv // bv
    slot, pos = slot_ref[i], pos_ref[i]
    live = fresh_ref[i] == 0  # a fresh sequence's state starts at zero (never what its slot holds): not loaded

    def state_block(j: int):
        return plgpu.load(s_ref.at[slot, h, :, pl.ds(j * bv, bv)], mask=jnp.broadcast_to(live, (dk, bv)), other=0.0,
                          eviction_policy=evict)

    row = jax.lax.rem(jax.lax.rem(pos, taps) + taps, taps)  # the ring row this position writes

    def window(offset: int | jax.Array, n: int):
        """Loads this row's conv inputs for channels [offset, offset + n): (x, the K - 1 previous inputs from the
        ring, the taps' weights)."""
        cols = pl.ds(offset, n)
        prev = [cs_ref[slot, jax.lax.rem(pos - d + taps, taps), cols] for d in range(1, taps)]
        return x_ref[i, cols], prev, [w_ref[cols, t] for t in range(taps)]

    def conv(x, prev, w):
        """The conv output (SiLU, rounded to the activation dtype as the general path stores it)."""
        acc = x.astype(jnp.float32) * w[taps - 1].astype(jnp.float32)
        for d in range(1, taps):  # d positions back: ring row (pos - d) mod K, zero before position 0
            acc = acc + jnp.where(pos >= d, prev[d - 1].astype(jnp.float32), 0.0) * w[taps - 1 - d].astype(jnp.float32)
        return (acc * jax.nn.sigmoid(acc)).astype(x_ref.dtype).astype(jnp.float32)

    # Every load before any use: the state's first two column blocks (the bulk of the bytes), the conv windows,
    # the gates' inputs and z, in flight while the conv and the gates are computed; each later block's load is
    # issued before the previous block's work. ptxas schedules them (the SASS had the conv's loads and the q / k
    # norms ahead of the state's); the source's order, state first or last, measured the same (115.9 / 115.6 us
    # at batch 64: gdn_decode_ab_h100_cae9e15.jsonl, gdn_decode_blocks_h100_e8b5162.json).
    q_off, k_off, v_off = kh * dk, hk * dk + kh * dk, 2 * hk * dk + h * dv
    blocks = [state_block(j) for j in range(min(nb, 2))]
    q_win, k_win = window(q_off, dk), window(k_off, dk)
    v_wins = [window(v_off + j * bv, bv) for j in range(nb)]
    b_x, a_x = x_ref[i, b_col + h], x_ref[i, a_col + h]
    a_log, dt_b = alog_ref[h], dtb_ref[h]
    if z_col is not None:
        zs = [x_ref[i, pl.ds(z_col + h * dv + j * bv, bv)] for j in range(nb)]
        nw = [nw_ref[pl.ds(j * bv, bv)] for j in range(nb)]

    q, k = conv(*q_win), conv(*k_win)
    q = q * jax.lax.rsqrt(jnp.sum(q * q) + L2_EPS) * dk ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k) + L2_EPS)
    qk = jnp.sum(q * k)
    beta = jax.nn.sigmoid(b_x.astype(jnp.float32)).astype(x_ref.dtype).astype(jnp.float32)
    a = a_x.astype(jnp.float32) + dt_b.astype(jnp.float32)
    softplus = jnp.maximum(a, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(a)))
    decay = jnp.exp(-jnp.exp(a_log.astype(jnp.float32)) * softplus)

    outs, sumsq = [], jnp.zeros((), jnp.float32)
    for j in range(nb):  # blocks of value columns: the rule is separable along them
        if j + 2 < nb:
            blocks.append(state_block(j + 2))
        cols = pl.ds(j * bv, bv)
        v = conv(*v_wins[j])
        state = blocks[j]
        # both reductions over the old state (o = q . S_new = decay q . S + (q . k) delta): neither waits on
        # the update
        ks = jnp.sum(k[:, None] * state, axis=0)
        qs = jnp.sum(q[:, None] * state, axis=0)
        delta = (v - decay * ks) * beta
        o = (decay * qs + qk * delta).astype(o_ref.dtype).astype(jnp.float32)  # [bv], rounded as stored
        plgpu.store(s_ref.at[slot, h, :, cols], state * decay + k[:, None] * delta[None, :], eviction_policy=evict)
        cs_ref[slot, row, pl.ds(v_off + j * bv, bv)] = v_wins[j][0].astype(cs_ref.dtype)  # its own v channels
        if z_col is None:
            o_ref[i, h, cols] = o.astype(o_ref.dtype)
        else:
            outs.append(o)
            sumsq = sumsq + jnp.sum(o * o)
    if z_col is not None:  # HF's RMSNormGated over the whole head (gated_rms_norm_reference's roundings)
        inv = jax.lax.rsqrt(sumsq / dv + eps)
        wdt = jnp.promote_types(nw_ref.dtype, o_ref.dtype)
        for j, o in enumerate(outs):
            cols = pl.ds(j * bv, bv)
            z = zs[j].astype(jnp.float32)
            o = (o * inv).astype(o_ref.dtype).astype(jnp.float32)
            o = (nw[j].astype(jnp.float32) * o).astype(wdt).astype(jnp.float32) * (z * jax.nn.sigmoid(z))
            o_ref[i, h, cols] = o.astype(o_ref.dtype)

    @pl.when(h % group == 0)  # the key head's q and k channels: by its first program
    def _():
        cs_ref[slot, row, pl.ds(q_off, dk)] = q_win[0].astype(cs_ref.dtype)
        cs_ref[slot, row, pl.ds(k_off, dk)] = k_win[0].astype(cs_ref.dtype)


EVICT_FIRST_MAX_ROWS = 128


@functools.partial(jax.jit, static_argnames=("num_k_heads", "key_dim", "value_dim", "b_col", "a_col", "z_col",
                                             "eps", "block_v", "num_warps", "evict", "interpret"),
                   donate_argnames=("conv_state", "states"))
def fused_decode_step(proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions, fresh, *,
                      num_k_heads: int, key_dim: int, value_dim: int, b_col: int, a_col: int,
                      z_col: int | None = None, norm_weight: jax.Array | None = None, eps: float = 1e-6,
                      block_v: int | None = None, num_warps: int | None = None, evict: str | None = "auto",
                      interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`decode_reference` in one kernel (module doc); the two pools are updated in place (donated).
    Dk and Dv powers of two >= 16. A program walks its state in blocks of `block_v` value columns (default:
    the whole head up to 128 x 128, 64 KB; halves past it), each block's load issued before the previous
    block's work; num_warps default 4 (8 past a 128 x 128 block). At Qwen3.5-4B's shapes, batch 64, one H100
    (gdn_decode_ab_h100_*.jsonl): 116 us for the whole head, 117 us in halves, 126 us in quarters.
    `evict`: the state's loads and stores' eviction policy (Triton's; None: the default); "auto" streams them
    with evict_first up to EVICT_FIRST_MAX_ROWS rows (1-3% faster at batch 32 / 64 / 128 in interleaved rounds,
    0.7% slower at 256: gdn_decode_evict*_h100_b801987.jsonl)."""
    B, W = proj.shape
    C, _, taps = conv_w.shape
    hk, dk, dv, hv = num_k_heads, key_dim, value_dim, a_log.shape[0]
    cols = [b_col, a_col] + ([z_col] if z_col is not None else [])
    if C != 2 * hk * dk + hv * dv or conv_state.shape[1:] != (taps, C) or conv_w.shape[1] != 1 \
            or max(b_col, a_col) + hv > W or min(cols) < C or (z_col is not None and z_col + hv * dv > W):
        raise ValueError(f"conv_w [C, 1, K] with C = 2 Hk Dk + Hv Dv, conv_state [S, K, C], z, b and a columns of "
                         f"proj past C: {proj.shape=} {conv_state.shape=} {conv_w.shape=} {b_col=} {a_col=} "
                         f"{z_col=} ({hk=} {dk=} {hv=} {dv=})")
    if states.shape[1:] != (hv, dk, dv) or states.dtype != jnp.float32 or hv % hk:
        raise ValueError(f"states must be float32 [S, {hv}, {dk}, {dv}] with Hv a multiple of Hk: {states.shape}")
    if dk & (dk - 1) or dv & (dv - 1) or min(dk, dv) < 16 or taps < 2:
        raise ValueError(f"key_dim={dk} and value_dim={dv} must be powers of two >= 16, the conv >= 2 taps")
    if (z_col is None) != (norm_weight is None) or (norm_weight is not None and norm_weight.shape != (dv,)):
        raise ValueError(f"the gated norm needs both z_col and norm_weight [{dv}]: {z_col=} "
                         f"{None if norm_weight is None else norm_weight.shape}")
    bv = block_v or min(dv, max(16, 128 * 128 // dk))
    if bv & (bv - 1) or not 16 <= bv <= dv:
        raise ValueError(f"block_v={bv} must be a power of two in [16, value_dim={dv}]")
    if num_warps is None:
        num_warps = 4 if dk * bv <= 128 * 128 else 8
    if evict == "auto":
        evict = "evict_first" if B <= EVICT_FIRST_MAX_ROWS else None
    whole = pl.no_block_spec
    kernel = functools.partial(_decode_kernel, hk=hk, group=hv // hk, dk=dk, dv=dv, bv=bv, taps=taps, b_col=b_col,
                               a_col=a_col, z_col=z_col, eps=eps, evict=evict)
    norm = norm_weight if norm_weight is not None else jnp.ones((dv,), proj.dtype)
    o, conv_state, states = pl.pallas_call(
        kernel,
        grid=(hv, B),
        in_specs=[whole] * 10,
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, hv, dv), proj.dtype),
                   jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
                   jax.ShapeDtypeStruct(states.shape, jnp.float32)],
        input_output_aliases={4: 1, 9: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gated_delta_decode" + ("_norm" if z_col is not None else ""),
    )(slots.astype(jnp.int32), positions.astype(jnp.int32), fresh.astype(jnp.int32), proj, conv_state,
      conv_w[:, 0, :], a_log, dt_bias, norm, states)
    return o, conv_state, states
