"""Gated DeltaNet's (linear attention's) kernel choices: the delta rule, the fused decode step, the causal conv and
the gated RMSNorm, each Pallas or the kernel module's jnp reference.

The rule over a ragged batch (`gated_delta_rule`): sequences with >= MIN_LEN (64) new rows run in chunks
(pallas_kernels/linear_attention/gated_delta_rule_chunked.py: tensor-core matmuls), the others (decode rows, short
chunks of a chunked prefill) in the recurrent kernel (gated_delta_rule.py), which would walk a long prefill's rows
one by one; a step of fewer than MIN_LEN rows only launches the recurrent one. Each kernel skips the other's
sequences and writes its own rows of one zeroed output buffer (in out_dtype: no float32 copy of o goes through HBM),
so a mixed step costs both their work only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, *, backend: str = "reference",
                     interpret: bool = False, chunked: bool = True, out_dtype=jnp.float32,
                     packed_k_heads: int | None = None, write_slots=None, keep=None) -> tuple[jax.Array, jax.Array]:
    """The rule over a ragged batch (layout: pallas_kernels/linear_attention/gated_delta_rule.py): (o [T, Hv, Dv] in
    out_dtype, the updated states pool).

    backend "reference": `recurrent_reference`. "pallas": long sequences chunked, the rest recurrent (module doc).
    chunked=False (decode-only steps, where no sequence can be long): the recurrent kernel alone, without the chunked
    part's dozen or so small ops per layer. packed_k_heads: q holds q|k|v (`head_views`). write_slots (None:
    `slots`): where each sequence's final state goes; keep (None: none): where > 0, the state after a sequence's
    first keep[b] rows goes to slots[b] too (the recurrent kernel runs those sequences, however long: a long row
    with drafts comes only from a recompute after preemption).
    """
    from pallas_kernels.linear_attention.gated_delta_rule_common import head_shapes, recurrent_reference, unpack_heads

    if backend != "pallas":
        o, states = recurrent_reference(*unpack_heads(q, k, v, packed_k_heads), g, beta, states, slots, fresh,
                                        query_start, write_slots, keep)
        return o.astype(out_dtype), states
    from pallas_kernels.linear_attention.gated_delta_rule import recurrent_gated_delta_rule
    from pallas_kernels.linear_attention.gated_delta_rule_chunked import MIN_LEN, chunked_gated_delta_rule

    hv, dv = head_shapes(q, k, v, packed_k_heads)[2].shape[1:]
    out = jnp.zeros((q.shape[0], hv, dv), out_dtype)
    pk = dict(packed_k_heads=packed_k_heads, interpret=interpret, write_slots=write_slots, keep=keep)
    if not chunked or q.shape[0] < MIN_LEN:
        return recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, out=out, **pk)
    short = query_start[1:] - query_start[:-1] < MIN_LEN
    if keep is not None:
        short = short | (keep > 0)
    out, states = recurrent_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, short, out, **pk)
    return chunked_gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, out=out, min_len=MIN_LEN,
                                    **pk)


class LinearAttentionOps:
    """ModelOps' Gated DeltaNet ops (mixed into `jinfer.ops.ModelOps`, whose fields they read)."""

    def token_sequences(self, query_start: jax.Array, num_tokens: int) -> jax.Array:
        """[T] the sequence of each row; B (one past the last) for padding rows."""
        from pallas_kernels.linear_attention.gated_delta_rule_common import token_sequences

        return token_sequences(query_start, num_tokens)

    def delta_rule_gates(self, b: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array
                         ) -> tuple[jax.Array, jax.Array]:
        """(beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)), float32 [T, Hv], rounded as HF's."""
        from pallas_kernels.linear_attention.gated_delta_rule_decode import gates

        return gates(b, a, a_log, dt_bias)

    def gated_delta_rule(self, q, k, v, g, beta, states, slots, fresh, query_start, out_dtype=jnp.float32,
                         packed_k_heads: int | None = None, write_slots=None, keep=None):
        """Gated DeltaNet's recurrence over the ragged batch, each sequence from / to its state slot
        (`gated_delta_rule`; decode steps the recurrent kernel only). packed_k_heads: q holds q|k|v, k = v = None
        (the conv output as is, no slices copied out); write_slots (None: `slots`) where the final states go, keep
        (None: none) the rows after which the slots read take the state too (`gated_delta_rule`).
        Returns (o [T, Hv, Dv] in out_dtype, the updated state pool)."""
        return gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, backend=self.backend,
                                interpret=self.interpret, chunked=not self.decode_step, out_dtype=out_dtype,
                                packed_k_heads=packed_k_heads, write_slots=write_slots, keep=keep)

    def gated_delta_decode(self, proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions, fresh, *,
                           num_k_heads: int, key_dim: int, value_dim: int, b_col: int, a_col: int, z_col: int,
                           norm_weight: jax.Array, eps: float):
        """A Gated DeltaNet layer's conv, gates, delta rule and gated RMSNorm for a step of one new row per
        sequence (row b is sequence b's, at `positions[b]`), from its input projection `proj` (q | k | v at
        [0, conv_dim), z at z_col, b and a at b_col, a_col): (o [B, Hv, Dv] in proj's dtype, normalised and
        gated; conv pool; state pool). Pallas: one fused kernel (gated_delta_rule_decode.py); reference: the same
        formulas in jnp."""
        from pallas_kernels.linear_attention.gated_delta_rule_decode import decode_reference, fused_decode_step

        dims = dict(num_k_heads=num_k_heads, key_dim=key_dim, value_dim=value_dim, b_col=b_col, a_col=a_col,
                    z_col=z_col, norm_weight=norm_weight, eps=eps)
        args = (proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions, fresh)
        if self.decode_step and proj.shape[0] != slots.shape[0]:
            raise ValueError(f"a decode step has one row per sequence: {proj.shape[0]} rows, {slots.shape[0]} seqs")
        if self.backend == "pallas":
            return fused_decode_step(*args, **dims, interpret=self.interpret)
        return decode_reference(*args, **dims)

    def causal_conv(self, x, conv_state, weight, seq, starts, query_start, slots, positions, write_slots=None,
                    keep=None):
        """Qwen3.5's depthwise causal conv + SiLU over a ragged batch from each sequence's conv ring, and the rings'
        update, for the first C = weight.shape[0] columns of x [T, W] (the layer's input projection: read in
        place): (y [T, C], the pool). Pallas: y from one kernel (causal_conv.py; C a multiple of 128); reference:
        the kernel's jnp reference. The rings' update in XLA either way, to `write_slots` (None: `slots`), and where
        keep > 0 the rings after each sequence's first keep[b] rows to `slots` (`ring_update`)."""
        from pallas_kernels.linear_attention.causal_conv import causal_conv, causal_conv_reference, ring_update

        C = weight.shape[0]
        if self.backend != "pallas" or C % 128:
            return causal_conv_reference(x, conv_state, weight, seq, starts, query_start, slots, positions, write_slots,
                                         keep)
        y = causal_conv(x, conv_state, weight, seq, starts, slots, positions, interpret=self.interpret)
        return y, ring_update(x[:, :C], conv_state, slots, query_start, positions, write_slots, keep)

    def gated_rms_norm(self, x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float,
                       gate_col: int | None = None) -> jax.Array:
        """HF's RMSNormGated: weight * rms_norm(x) (rounded to x's dtype), times silu(gate) in float32. x [T, H, D];
        gate [T, H, D], or with gate_col the [T, W] array holding the gates at columns [gate_col, gate_col + H D)
        (the layer's projection, read in place by the kernel)."""
        from pallas_kernels.linear_attention.gated_rms_norm import gated_rms_norm, gated_rms_norm_reference

        if self.backend == "pallas" and not x.shape[-1] & (x.shape[-1] - 1):
            return gated_rms_norm(x, gate, weight, eps=eps, gate_col=gate_col, interpret=self.interpret)
        if gate_col is not None:
            gate = gate[:, gate_col:gate_col + x.shape[1] * x.shape[2]].reshape(x.shape)
        return gated_rms_norm_reference(x, gate, weight, eps)
