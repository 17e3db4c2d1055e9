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

MLA (DeepSeek's latent cache): decode steps take the MLA decode kernel (pallas_kernels/attention/mla_decode.py);
prefill chunks and mixed steps the jnp reference for now (no MLA prefill kernel yet).
"""

from __future__ import annotations

import jax

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
        all of a sequence's heads); anything else, and shapes the kernel does not take, the jnp reference."""
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
