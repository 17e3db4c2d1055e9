"""Attention over the paged KV cache: decode (Triton), ragged prefill (Triton and Mosaic GPU)."""
