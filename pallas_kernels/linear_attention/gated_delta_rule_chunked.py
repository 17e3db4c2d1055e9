"""The gated delta rule in chunks (flash-linear-attention's chunked WY form) over a ragged batch: prefill.

Same rule, layout and state pool as pallas_kernels/linear_attention/gated_delta_rule.py (read its doc first). Token by
token, the rule is a chain of rank-1 updates; in chunks of C = 64 rows it becomes matmuls. Within one
chunk of a sequence (rows i, j; gc the cumulative log-decay from the chunk's start, S the state entering
the chunk):

    L     = strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))          [C, C]
    W     = (I + L)^-1 (beta exp(gc) K)                               [C, Dk]   (the WY form: one
    U     = (I + L)^-1 (beta V)                                       [C, Dv]    triangular solve)
    V'    = U - W S                                                   [C, Dv]   (the chunk's deltas)
    O     = (Q exp(gc)) S + lower(Q K^T exp(gc_i - gc_j)) V'          [C, Dv]
    S'    = exp(gc_last) S + (K exp(gc_last - gc))^T V'               [Dk, Dv]

(HF's `torch_chunk_gated_delta_rule`; fla's chunk.py: chunk_local_cumsum, chunk_scaled_dot_kkt +
solve_tril + recompute_w_u (wy_fast.py), chunk_gated_delta_rule_fwd_h (chunk_delta_h.py), chunk_fwd_o.)

Varlen: sequence b's new rows `query_start[b]:query_start[b + 1]` are cut into ceil(n_b / C) chunks that
never cross a sequence boundary; a sequence's last chunk is padded with rows of zeros (k = 0, g = 0,
beta = 0: they leave the state as it is). Only sequences of at least `min_len` new rows run here (the
others are left to the recurrent kernel: a decode row costs a whole chunk of work in this form); their
rows' outputs are zeros and their slots are left alone.

Two phases:
- The intra-chunk part: everything that does not depend on the state, for all chunks at once
  (pallas_kernels/linear_attention/gated_delta_rule_intra.py: the fused kernel `intra_chunk_pallas`, one program per
  chunk and value head, reading the activations and writing W, U, Qg, Kd, P in their dtype; its jnp
  reference `intra_chunk` (gated_delta_rule_intra.py), all float32 through HBM).
- The inter-chunk recurrence, sequential along each sequence: the Pallas kernel
  (`chunked_gated_delta_rule`, Triton lowering) runs one program per (sequence, value head, block of
  value columns), keeps its [Dk, block_v] slice of the state in registers, walks the sequence's chunks
  with four dots per chunk (W S and Q e^g S: [C, Dk] x [Dk, block_v]; P V': [C, C] x [C, block_v];
  Kd^T V': [Dk, C] x [C, block_v]), stores each chunk's output rows straight into the step's [T, Hv, Dv]
  output (masked past the sequence's end; the recurrent kernel writes the other sequences' rows of the same
  buffer) and writes the slice back to the sequence's slot in place.
    `chunked_reference` is the same algorithm with the recurrence as a `lax.scan` over chunk positions (all
  sequences at once); both are tested against the token-by-token
  `recurrent_reference` (which is golden-checked against HF).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import search_right
from pallas_kernels.linear_attention.gated_delta_rule_common import (
    check_out,
    check_shapes,
    head_shapes,
    initial_states,
    unpack_heads,
)
from pallas_kernels.linear_attention.gated_delta_rule_intra import intra_chunk, intra_chunk_pallas

CHUNK = 64  # rows per chunk (fla and HF use 64)
MIN_LEN = 64  # sequences with fewer new rows are left to the recurrent kernel


def max_chunks(num_tokens: int, num_seqs: int, chunk: int = CHUNK, min_len: int = 1) -> int:
    """A static bound on the chunks of a step: sum ceil(n_b / C) <= T // C + (sequences with n_b >= min_len)."""
    return num_tokens // chunk + min(num_seqs, num_tokens // max(min_len, 1))


def chunk_layout(query_start: jax.Array, num_tokens: int, num_chunks: int, chunk: int = CHUNK,
                 min_len: int = 1, skip: jax.Array | None = None) -> dict[str, jax.Array]:
    """Where each chunk's rows come from, for the sequences with >= min_len new rows (but those `skip` [B] marks).

    Returns {"long": [B] bool (runs chunked), "chunk_start": [B + 1] each sequence's first chunk,
    "rows": [NC, C] row of each chunk row (num_tokens for padding: the zero row), "row_chunk": [T] and
    "row_offset": [T] each row's chunk and place in it, "row_long": [T] bool (the row runs chunked)}.
    """
    B = query_start.shape[0] - 1
    n = query_start[1:] - query_start[:-1]  # [B]
    long = n >= min_len if skip is None else (n >= min_len) & ~skip
    nch = jnp.where(long, (n + chunk - 1) // chunk, 0)
    chunk_start = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(nch).astype(jnp.int32)])  # [B + 1]
    c = jnp.arange(num_chunks, dtype=jnp.int32)
    seq = search_right(chunk_start[1:], c).astype(jnp.int32)  # [NC]; B for unused chunks
    b = jnp.minimum(seq, B - 1)
    start = query_start[b] + (c - chunk_start[b]) * chunk
    rows = start[:, None] + jnp.arange(chunk, dtype=jnp.int32)[None, :]  # [NC, C]
    valid = (seq < B)[:, None] & (rows < query_start[b + 1][:, None])
    rows = jnp.where(valid, rows, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    row_seq = search_right(query_start[1:], t).astype(jnp.int32)  # [T]; B for padding
    rb = jnp.minimum(row_seq, B - 1)
    local = t - query_start[rb]
    row_long = (row_seq < B) & long[rb]
    return {"long": long, "chunk_start": chunk_start, "rows": rows,
            "row_chunk": jnp.where(row_long, chunk_start[rb] + local // chunk, 0),
            "row_offset": local % chunk, "row_long": row_long}


def _rows_out(o_chunks, layout) -> jax.Array:
    """[NC, Hv, C, Dv] chunk outputs -> [T, Hv, Dv] rows (zeros where a row does not run chunked)."""
    o = o_chunks[layout["row_chunk"], :, layout["row_offset"]]  # [T, Hv, Dv]
    return jnp.where(layout["row_long"][:, None, None], o, 0.0)


def _write_states(states, slots, layout, finals) -> jax.Array:
    """The final states of the chunked sequences into their (write) slots; the others' slots keep what they hold."""
    keep = states[slots]
    return states.at[slots].set(jnp.where(layout["long"][:, None, None, None], finals, keep))


def chunked_reference(q, k, v, g, beta, states, slots, fresh, query_start, *, min_len: int = 1,
                      chunk: int = CHUNK, write_slots=None, keep=None) -> tuple[jax.Array, jax.Array]:
    """The chunked algorithm in jnp: `intra_chunk`, then the recurrence as a scan over chunk positions (all
    sequences at once). Same arguments and results as `recurrent_reference`, for the sequences with >=
    min_len new rows but those with keep > 0 (the others: zero outputs, slots untouched)."""
    T, B = q.shape[0], slots.shape[0]
    nc = max_chunks(T, B, chunk, min_len)
    layout = chunk_layout(query_start, T, nc, chunk, min_len, None if keep is None else keep > 0)
    parts = intra_chunk(q, k, v, g, beta, layout["rows"])
    cs = layout["chunk_start"]
    steps = -(-T // chunk)  # the most chunks one sequence can have
    hp = jax.lax.Precision.HIGHEST

    def step(s, j):  # s: [B, Hv, Dk, Dv]
        c = cs[:-1] + j  # [B]
        on = c < cs[1:]
        cc = jnp.minimum(c, nc - 1)
        w, u, qg, kd, p, dl = (parts[x][cc] for x in ("w", "u", "qg", "kd", "p", "dl"))
        vn = u - jnp.einsum("bhck,bhkv->bhcv", w, s, precision=hp)
        o = jnp.einsum("bhck,bhkv->bhcv", qg, s, precision=hp) + jnp.einsum("bhcd,bhdv->bhcv", p, vn, precision=hp)
        s_new = s * dl[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", kd, vn, precision=hp)
        return jnp.where(on[:, None, None, None], s_new, s), o

    finals, o = jax.lax.scan(step, initial_states(states, slots, fresh), jnp.arange(steps))  # o: [steps, B, ...]
    c = jnp.arange(nc)
    seq = jnp.minimum(search_right(cs[1:], c), B - 1)
    o_chunks = o[jnp.clip(c - cs[seq], 0, steps - 1), seq]  # [NC, Hv, C, Dv]
    return _rows_out(o_chunks, layout), _write_states(states, slots if write_slots is None else write_slots, layout,
                                                      finals)


# ----------------------------------------------------------------------------------------------
# Kernel body: the inter-chunk recurrence
# ----------------------------------------------------------------------------------------------
def _chunk_state_kernel(qs_ref, cs_ref, slot_ref, wslot_ref, fresh_ref, w_ref, u_ref, qg_ref, kd_ref, p_ref, dl_ref,
                        s_in_ref, o_in_ref, o_ref, s_ref, *, block_v: int, precision):
    # qs_ref [B + 1]: row ranges; cs_ref [B + 1]: each sequence's chunks; slot_ref (read), wslot_ref (written),
    # fresh_ref [B]; w_ref, qg_ref,
    # kd_ref [NC, Hv, C, Dk]; u_ref [NC, Hv, C, Dv]; p_ref [NC, Hv, C, C] (these five f32 or bf16); dl_ref [NC, Hv]
    # f32; s_in_ref / s_ref [S, Hv, Dk, Dv] f32: the pool, aliased; o_in_ref / o_ref [T, Hv, Dv]: the output rows,
    # aliased (only the chunked sequences' rows are written, in o_ref's dtype).
    del s_in_ref, o_in_ref  # the same buffers as s_ref, o_ref
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    first, last = cs_ref[b], cs_ref[b + 1]
    C = u_ref.shape[2]
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)
    f32 = jnp.float32  # the parts may be stored in bf16: the dots run on float32 values against the f32 state

    @pl.when(last > first)  # a sequence left to the recurrent kernel: its slot is not touched
    def _():
        slot = slot_ref[b]
        state = s_ref[slot, h, :, cols]  # [Dk, block_v]
        state = jnp.where(fresh_ref[b] != 0, 0.0, state)
        row0, end = qs_ref[b] - first * C, qs_ref[b + 1]  # chunk c's rows: row0 + c C + [0, C), those < end

        def body(c, state):
            vn = u_ref[c, h, :, cols].astype(f32) - dot(w_ref[c, h, :, :].astype(f32), state)  # [C, block_v]
            o = dot(qg_ref[c, h, :, :].astype(f32), state) + dot(p_ref[c, h, :, :].astype(f32), vn)
            rows = row0 + c * C + jnp.arange(C)
            plgpu.store(o_ref.at[pl.ds(row0 + c * C, C), h, cols], o.astype(o_ref.dtype),
                        mask=jnp.broadcast_to((rows < end)[:, None], (C, block_v)))
            kd = kd_ref[c, h, :, :].astype(f32)  # [C, Dk]
            return state * dl_ref[c, h] + jax.lax.dot_general(kd, vn, (((0,), (0,)), ((), ())), precision=precision,
                                                              preferred_element_type=jnp.float32)

        s_ref[wslot_ref[b], h, :, cols] = jax.lax.fori_loop(first, last, body, state)


def _chunk_state_call(parts, states, slots, write_slots, fresh, query_start, chunk_start, out, *, block_v, num_warps,
                      num_stages, precision, interpret):
    hv, dv = parts["u"].shape[1], parts["u"].shape[3]
    B = slots.shape[0]
    whole = pl.no_block_spec
    kernel = functools.partial(_chunk_state_kernel, block_v=block_v, precision=precision)
    return pl.pallas_call(
        kernel,
        grid=(B, hv, dv // block_v),
        in_specs=[whole] * 13,
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(states.shape, jnp.float32)],
        input_output_aliases={12: 0, 11: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"chunked_gated_delta_rule_bv{block_v}",
    )(query_start.astype(jnp.int32), chunk_start, slots.astype(jnp.int32), write_slots.astype(jnp.int32),
      fresh.astype(jnp.int32), parts["w"], parts["u"], parts["qg"], parts["kd"], parts["p"], parts["dl"], states, out)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
INTRA_WIDE_CHUNKS = 128  # the intra-chunk kernel's warps by chunk count (H100, gdn_intra_h100.json)
# value heads per intra-chunk program (2 shares a key head's loads and dots: no faster on an H100,
# gdn_intra_hpp_h100_f049656.json, nor end to end)
INTRA_HEADS_PER_PROGRAM = 1


@functools.partial(jax.jit, static_argnames=("min_len", "block_v", "num_warps", "num_stages", "exact", "intra",
                                             "parts_dtype", "packed_k_heads", "interpret"),
                   donate_argnames=("states", "out"))
def chunked_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, out=None, *, min_len: int = 1,
                             write_slots=None, keep=None, block_v: int | None = None, num_warps: int = 4,
                             num_stages: int = 2,
                             exact: bool = False, intra: str = "pallas", parts_dtype=None,
                             packed_k_heads: int | None = None, interpret: bool = False
                             ) -> tuple[jax.Array, jax.Array]:
    """The rule in chunks over the sequences of >= min_len new rows of a ragged batch (module doc), updating
    their state slots in place (the pool is donated); other sequences get zero outputs and keep their slots.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (or q|k|v packed in q, k = v = None: gated_delta_rule.head_views); g,
    beta: [T, Hv]; states: [S, Hv, Dk, Dv] float32; slots, fresh:
    [B]; query_start: [B + 1]; out: [T, Hv, Dv] or None (zeros, float32): the output buffer (donated), of which
    only the chunked sequences' rows are written, in its dtype (the recurrent kernel fills the others);
    write_slots [B] (None: `slots`): where each sequence's final state goes; keep [B] (None: zeros): the sequences
    with keep > 0, which keep a state after their first rows too, are left to the recurrent kernel (which writes it;
    gated_delta_rule.py), whatever their length. Returns (o, the pool). Dk, Dv powers
    of two >= 16.
    exact: the kernels' dots in full float32 (default: TF32 on the GPU's tensor cores). intra: the
    intra-chunk part by the fused kernel ("pallas") or by XLA ("jnp": `intra_chunk`, float32); parts_dtype:
    the dtype the kernel stores W, U, Qg, Kd, P in (default v's: bf16 in the model, as fla).
    """
    hv, dk, dv = check_shapes(*head_shapes(q, k, v, packed_k_heads), g, beta, states, min_dim=16)  # tensor cores
    T = q.shape[0]
    block_v = block_v or min(dv, 32)
    if dv % block_v or block_v < 16:
        raise ValueError(f"block_v={block_v} must divide value_dim={dv} and be >= 16")
    if min_len < 1:
        raise ValueError(f"{min_len=} must be >= 1")
    if intra not in ("pallas", "jnp"):
        raise ValueError(f"intra={intra!r} must be 'pallas' or 'jnp'")
    B = slots.shape[0]
    nc = max_chunks(T, B, CHUNK, min_len)
    layout = chunk_layout(query_start, T, nc, CHUNK, min_len, None if keep is None else keep > 0)
    if intra == "pallas":  # 8 warps from 128 chunks: 1.82 vs 2.80 ms at 16k tokens, 4: 0.17 vs 0.26 ms at 1k
        parts = intra_chunk_pallas(q, k, v, g, beta, layout["rows"], out_dtype=parts_dtype, exact=exact,
                                   num_warps=8 if nc >= INTRA_WIDE_CHUNKS else 4, packed_k_heads=packed_k_heads,
                                   heads_per_program=INTRA_HEADS_PER_PROGRAM, interpret=interpret)
    else:
        parts = intra_chunk(*unpack_heads(q, k, v, packed_k_heads), g, beta, layout["rows"])
    precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
    write_slots = slots if write_slots is None else write_slots
    return _chunk_state_call(parts, states, slots, write_slots, fresh, query_start, layout["chunk_start"],
                             check_out(out, T, hv, dv), block_v=block_v, num_warps=num_warps, num_stages=num_stages,
                             precision=precision, interpret=interpret)
