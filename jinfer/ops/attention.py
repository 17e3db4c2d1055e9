"""Attention's kernel choice (H100 measurements, benchmarks/results/kernels_h100.json).

A decode step (every sequence has one new token: batch-1 decode, or an executable the runner compiled with
`decode_step` for the decode-only steps of a bucket with B = T) takes the paged decode kernel; anything else
(prefill chunks, mixed steps) the ragged prefill kernels, split by sequence: those with >= mosaic_min_query_len new
tokens go to the Mosaic GPU kernel (TMA + wgmma, one query head per tile; prefill_attention_mgpu.py), the rest
(decodes, short chunks) and the padding to the Triton kernel, which packs a kv head's query heads into one tile.
The ragged kernel reads decode batches at 2.17 TB/s where the decode kernel reaches 2.44 (64 x 2k, random pages;
`kernels_h100_repeat3.json`), hence the decode-only executables. Speculative decoding's verify steps (every sequence
at most Q = 1 + k new tokens: an executable the runner compiled with `verify_query_len` Q) take the paged decode
kernel too, its rows a sequence's Q tokens x a kv head's query heads. A step of fewer than mosaic_min_step_tokens tokens
never launches the Mosaic kernel. The reference is the kernel module's own jnp reference, which gathers every page
of each token's sequence.

An FP8 cache (float8_e4m3fn pages with k_scale / v_scale per kv head, `--kv-cache-dtype fp8`) takes the same kernels,
which dequantize as they load, but for the Mosaic GPU kernel (its TMA ring feeds the wgmmas straight from SMEM, with no
room for a conversion): its sequences go to the Triton prefill kernel.

MLA (DeepSeek's latent cache): decode steps take the MLA decode kernel (pallas_kernels/attention/mla_decode.py), in the
absorbed form. Every other step (prefill chunks, mixed and verify steps) the ragged MLA kernels (mla_prefill.py): a
sequence with >= mla_expand_min_query_len new tokens attends to its own new tokens in the expanded form (their K/V
decompressed by kv_b_proj: a temporary of the step's tokens x heads x (nope + v), never the context's) and to the
context before them in the absorbed form, the two merged by their log-sum-exps; shorter sequences (decodes in a mixed
step, verify rows) absorbed only, over their whole context.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jinfer.models.batch import Batch


class AttentionOps:
    """ModelOps' attention (mixed into `jinfer.ops.ModelOps`, whose fields it reads)."""

    def attention(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: Batch, scale: float,
                  k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
        """q: [T, H, D] -> [T, H, D], each token over its sequence's pages (K/V already written). k_scale, v_scale:
        an FP8 cache's float32 scales [KVH]."""
        from pallas_kernels.attention.prefill_attention import (
            ragged_prefill_attention,
            ragged_prefill_attention_reference,
        )

        if self.backend == "reference":
            return ragged_prefill_attention_reference(q, k_cache, v_cache, batch.query_start, batch.seq_lens,
                                                      batch.page_table, k_scale, v_scale, scale=scale)
        from pallas_kernels.attention.paged_attention import paged_decode_attention

        # Each sequence at most that many tokens (the runner checked). Not over an FP8 cache: that case of the kernel
        # missed its reference on an H200 (tests/kernels/test_paged_attention.py, an expected failure there).
        if self.verify_query_len > 1 and k_scale is None:
            return paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, k_scale, v_scale,
                                          query_start=batch.query_start, query_len=self.verify_query_len, scale=scale,
                                          interpret=self.interpret, **self.policy.launch_args("paged_decode_attention"))
        if self.decode_step and q.shape[0] != batch.num_seqs:
            raise ValueError(f"a decode step needs one token per sequence: {q.shape[0]} tokens, "
                             f"{batch.num_seqs} sequences")
        if self.decode_step or (q.shape[0] == 1 and batch.num_seqs == 1):
            return paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, k_scale, v_scale,
                                          scale=scale, interpret=self.interpret,
                                          **self.policy.launch_args("paged_decode_attention"))
        args = (q, k_cache, v_cache, batch.query_start, batch.seq_lens, batch.page_table)
        scales = dict(k_scale=k_scale, v_scale=v_scale)
        policy = self.policy
        if not self.mosaic_prefill or q.shape[0] < policy.mosaic_min_step_tokens:
            return ragged_prefill_attention(*args, **scales, scale=scale, interpret=self.interpret)
        from pallas_kernels.attention.prefill_attention_mgpu import (
            check_supported,
            long_sequences,
            ragged_prefill_attention_mgpu,
        )

        if check_supported(q, k_cache) is not None:
            return ragged_prefill_attention(*args, **scales, scale=scale, interpret=self.interpret)
        # The Mosaic kernel writes the long sequences' rows; the Triton kernel then fills in the rest
        # of the same buffer (in place).
        out = ragged_prefill_attention_mgpu(*args, scale=scale, min_query_len=policy.mosaic_min_query_len,
                                            interpret=self.interpret)
        rest = ~long_sequences(batch.query_start, policy.mosaic_min_query_len)
        return ragged_prefill_attention(*args, rest, out, scale=scale, interpret=self.interpret)

    def latent_attention(self, q: jax.Array, latent: jax.Array, batch: Batch, scale: float,
                         value_dim: int) -> jax.Array:
        """Multi-head latent attention in its absorbed form: q [T, H, L] (each head's query in the latent space,
        then its RoPE part) over its sequence's latent rows `latent` [pages, page_size, L] (written already) ->
        [T, H, value_dim], the softmax-weighted first `value_dim` values of the rows (the latent itself). One K/V
        "head" that every query head reads. Decode steps take the MLA decode kernel (each latent row loaded once for
        all of a sequence's heads); anything else, and shapes the kernel does not take, the jnp reference (the other
        Pallas steps come here only with `mla_ragged_kernel` off or sizes the ragged kernels do not take)."""
        from pallas_kernels.attention.prefill_attention import ragged_prefill_attention_reference

        if self.backend == "pallas" and (self.decode_step or (q.shape[0] == 1 and batch.num_seqs == 1)):
            from pallas_kernels.attention.mla_decode import check_supported, mla_decode_attention

            if self.decode_step and q.shape[0] != batch.num_seqs:
                raise ValueError(f"a decode step needs one token per sequence: {q.shape[0]} tokens, "
                                 f"{batch.num_seqs} sequences")
            if check_supported(q, latent, value_dim) is None:
                return mla_decode_attention(q, latent, batch.page_table, batch.seq_lens, kv_lora_rank=value_dim,
                                            scale=scale, interpret=self.interpret,
                                            **self.policy.launch_args("mla_decode_attention"))
        rows = latent[:, :, None, :]  # [pages, page_size, 1, L]
        out = ragged_prefill_attention_reference(q, rows, rows, batch.query_start, batch.seq_lens, batch.page_table,
                                                 scale=scale)
        return out[..., :value_dim]

    def mla_attention(self, q_nope: jax.Array, q_pe: jax.Array, rows: jax.Array, w_kv: jax.Array, latent: jax.Array,
                      batch: Batch, scale: float) -> jax.Array:
        """DeepSeek's multi-head latent attention -> [T, H, v]. q_nope [T, H, nope] and q_pe [T, H, P] (RoPE applied);
        rows [T, R + P] this step's latent rows [c | k_pe] (already written into `latent` [pages, page_size, R + P]);
        w_kv [R, H, nope + v] (kv_b_proj per head: W_UK | W_UV). The reference: the absorbed form (q_nope through
        W_UK against the latent rows, the weighted latent through W_UV); on the Pallas backend the module docstring's
        choice."""
        rank, nope = w_kv.shape[0], q_nope.shape[-1]
        q_latent = jnp.einsum("thn,lhn->thl", q_nope, w_kv[..., :nope])  # [T, H, R]: q_nope absorbed in W_UK
        one_token = self.decode_step or (q_nope.shape[0] == 1 and batch.num_seqs == 1)
        if self.backend == "pallas" and not one_token and self.policy.mla_ragged_kernel:
            from pallas_kernels.attention.mla_prefill import check_supported

            if check_supported(latent, rank, nope, w_kv.shape[2] - nope) is None:
                return self._mla_ragged(q_nope, q_latent, q_pe, rows, w_kv, latent, batch, scale)
        out = self.latent_attention(jnp.concatenate([q_latent, q_pe], axis=-1), latent, batch, scale, rank)
        return jnp.einsum("thl,lhv->thv", out, w_kv[..., nope:])  # [T, H, v]: through W_UV

    def _mla_ragged(self, q_nope, q_latent, q_pe, rows, w_kv, latent, batch, scale):
        from pallas_kernels.attention.mla_prefill import merge_attention, mla_absorbed_attention, mla_expanded_attention

        rank, nope = w_kv.shape[0], q_nope.shape[-1]
        num_tokens, qs, lens = q_nope.shape[0], batch.query_start, batch.seq_lens
        q_len = qs[1:] - qs[:-1]  # [B]
        threshold = self.policy.mla_expand_min_query_len
        # Statically absorbed only: expansion off, a verify step (every sequence <= verify_query_len tokens), or a
        # step too small to hold a long sequence.
        expand = 0 < threshold <= num_tokens and not 0 < self.verify_query_len < threshold
        long = q_len >= threshold if expand else jnp.zeros_like(q_len, dtype=bool)  # [B]
        limit = jnp.where(long, lens - q_len, lens)  # [B]: the absorbed part's keys (long: the context before)
        o_a, lse_a = mla_absorbed_attention(q_latent, q_pe, latent, qs, lens, batch.page_table, limit, limit > 0,
                                            scale=scale, interpret=self.interpret)
        out = jnp.einsum("thl,lhv->thv", o_a, w_kv[..., nope:])  # [T, H, v]: through W_UV
        if not expand:
            return out
        rows = rows.astype(latent.dtype)  # as the cache holds them
        kv = jnp.einsum("tl,lhn->thn", rows[:, :rank], w_kv.astype(rows.dtype))  # [T, H, nope + v]
        o_e, lse_e = mla_expanded_attention(q_nope, q_pe, kv, rows, qs, long, kv_lora_rank=rank, scale=scale,
                                            interpret=self.interpret)
        from pallas_kernels.common import search_right

        seq = search_right(qs, jnp.arange(num_tokens)) - 1  # [T]; B: padding tokens
        pad = jnp.zeros((1,), bool)
        long_t = jnp.concatenate([long, pad])[seq]  # [T]
        ctx_t = jnp.concatenate([limit > 0, pad])[seq]  # rows the absorbed kernel computed (others: unspecified)
        lse_a = jnp.where(ctx_t[:, None], lse_a, -jnp.inf)
        return jnp.where(long_t[:, None, None], merge_attention(out, lse_a, o_e.astype(out.dtype), lse_e), out)
