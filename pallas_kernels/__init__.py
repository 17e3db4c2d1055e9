"""Pallas GPU kernels, grouped by what they compute: attention/ (paged and MLA decode, ragged prefill: Triton, Mosaic
GPU), dense/ (fused SwiGLU MLP, norm + q|k|v + RoPE, skinny GEMM), moe/ (routing, grouped GEMMs: Triton and Mosaic
GPU), linear_attention/ (Gated DeltaNet: delta rule, conv, gated norm); common.py and split_k.py hold what several
share, kv_fp8.py the FP8 KV cache's format (plain jnp: the engine uses it too). Nothing here imports jinfer;
`jinfer.ops` picks the kernel per step, benchmarks/kernels/ times them.

Import from the modules (`pallas_kernels.attention.paged_attention`, ...); nothing is imported here.
Each module: kernel body -> wrapper (grid, block specs) -> public jitted function -> jnp reference.
Every kernel takes `interpret=True` to run in the Pallas interpreter (CPU).

GPU backends:
- `prefill_attention_mgpu` and `moe_gemm_mgpu` are Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`: TMA, wgmma,
  warp specialization), the supported GPU backend; they run on CPU in the Mosaic GPU interpreter.
- The others use the Pallas Triton lowering (the default lowering of `pl.pallas_call` on CUDA when given
  `plgpu.CompilerParams` from `jax.experimental.pallas.triton`), deprecated upstream. It expresses what Mosaic
  GPU's TMA cannot cheaply: gathers of whole pages by a page-id vector for tiles that pack a kv head's query heads
  (decode batches), and it already reaches ~86% of HBM bandwidth there. The one place that picks the lowering is
  each module's `CompilerParams` (attention backend "pallas-triton" keeps prefill on Triton).
"""
