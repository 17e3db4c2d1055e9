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
blocks: the model gives sequences of >= 64 new rows to the chunked (WY) form
(gated_delta_rule_chunked.py, tensor-core matmuls) and skips them here (`active`).
`recurrent_reference` (gated_delta_rule_common.py: token by token, exactly HF's
`torch_recurrent_gated_delta_rule`) is the reference. Which kernel takes which sequences is `jinfer.ops`' choice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.linear_attention.gated_delta_rule_common import (
    L2_EPS,
    check_out,
    check_shapes,
    head_shapes,
    head_views,
)


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _recurrent_kernel(qs_ref, slot_ref, wslot_ref, keep_ref, fresh_ref, active_ref, q_ref, k_ref, v_ref, g_ref,
                      beta_ref, s_in_ref, o_in_ref, o_ref, s_ref, *, group: int, block_v: int,
                      offsets: tuple[int, int, int]):
    # qs_ref [B + 1]: row ranges; slot_ref (read), wslot_ref (written), keep_ref (rows after which the state also goes
    # to the slot read, 0: none), fresh_ref, active_ref [B]; q_ref, k_ref
    # [T, Hk, Dk]; v_ref [T, Hv, Dv]
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
        keep = keep_ref[b]
        mid = jnp.minimum(start + keep, end)
        state = jax.lax.fori_loop(start, mid, body, state)

        @pl.when(keep > 0)  # the state after the first `keep` rows, into the slot read (this program's slice only)
        def _():
            s_ref[slot, h, :, cols] = state

        s_ref[wslot_ref[b], h, :, cols] = jax.lax.fori_loop(mid, end, body, state)


def _recurrent_call(q, k, v, g, beta, states, slots, write_slots, keep, fresh, query_start, active, out, *, hk,
                    block_v, num_warps, offsets, interpret):
    T, hv, dv = out.shape
    B = slots.shape[0]
    whole = pl.no_block_spec
    kernel = functools.partial(_recurrent_kernel, group=hv // hk, block_v=block_v, offsets=offsets)
    o, states = pl.pallas_call(
        kernel,
        grid=(dv // block_v, hv, B),
        in_specs=[whole] * 13,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(states.shape, jnp.float32)],
        input_output_aliases={12: 0, 11: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"recurrent_gated_delta_rule_bv{block_v}",
    )(query_start.astype(jnp.int32), slots.astype(jnp.int32), write_slots.astype(jnp.int32), keep.astype(jnp.int32),
      fresh.astype(jnp.int32), active.astype(jnp.int32), q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
      states, out)
    return o, states


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_v", "num_warps", "packed_k_heads", "interpret"),
                   donate_argnames=("states", "out"))
def recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, active=None, out=None, *,
                               write_slots=None, keep=None, block_v: int | None = None, num_warps: int = 4,
                               packed_k_heads: int | None = None, interpret: bool = False
                               ) -> tuple[jax.Array, jax.Array]:
    """The rule over a ragged batch (module doc), updating the state pool in place (donated).

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (or q|k|v packed in q, k = v = None: `head_views`); g, beta: [T, Hv];
    states: [S, Hv, Dk, Dv] float32; slots, fresh: [B]; query_start: [B + 1]; active: [B] bool or None (all):
    the sequences to run (the others' rows and slots are not touched: the chunked kernel runs them); out:
    [T, Hv, Dv] or None (zeros, float32): the output buffer (donated), of which only the active sequences'
    rows are written, in its dtype (so two kernels fill one buffer, each its own rows). write_slots [B] (None:
    `slots`): where each sequence's final state goes (read from slots[b]: a speculative row keeps the state before
    it); keep [B] (None: zeros): where > 0, the state after the sequence's first keep[b] rows is also written to
    slots[b] (a row verifying drafts keeps there the state after its known tokens). Returns (o, the pool). Dk and Dv
    powers of two.
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
    write_slots = slots if write_slots is None else write_slots
    keep = jnp.zeros_like(slots) if keep is None else keep
    return _recurrent_call(q, k, v, g, beta, states, slots, write_slots, keep, fresh, query_start, active, out,
                           hk=shapes[0].shape[1], block_v=block_v, num_warps=num_warps, offsets=offsets,
                           interpret=interpret)
