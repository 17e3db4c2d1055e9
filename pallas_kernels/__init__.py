"""Pallas GPU kernels: paged decode attention, ragged prefill attention, fused SwiGLU MLP.

Import from the modules (`pallas_kernels.attention.paged_attention`, `.prefill_attention`,
`.prefill_attention_mgpu`, `.fused_mlp`);
nothing is imported here, so `python -m pallas_kernels.<module>` runs a module's benchmark cleanly.
Each module: kernel body -> wrapper (grid, block specs) -> public jitted function -> jnp reference
-> `main()` benchmark. Every kernel takes `interpret=True` to run in the Pallas interpreter (CPU).

GPU backends:
- `prefill_attention_mgpu` is Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`: TMA, wgmma, warp
  specialization), the supported GPU backend; it runs on CPU in the Mosaic GPU interpreter.
- `paged_attention`, `prefill_attention` and `fused_mlp` use the Pallas Triton lowering (the default
  lowering of `pl.pallas_call` on CUDA when given `plgpu.CompilerParams` from
  `jax.experimental.pallas.triton`), deprecated upstream. It expresses what Mosaic GPU's TMA cannot
  cheaply: gathers of whole pages by a page-id vector for tiles that pack a kv head's query heads
  (decode batches), and it already reaches ~86% of HBM bandwidth there. The one place that picks
  the lowering is each module's `CompilerParams`; `jinfer.models.ops` picks the kernel per step
  (attention backend "pallas-triton" keeps prefill on Triton).
"""
