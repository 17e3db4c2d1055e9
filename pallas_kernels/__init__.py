"""Pallas GPU kernels: paged decode attention, ragged prefill attention, fused SwiGLU MLP.

Import from the modules (`pallas_kernels.paged_attention`, `.prefill_attention`, `.fused_mlp`);
nothing is imported here, so `python -m pallas_kernels.<module>` runs a module's benchmark cleanly.
Each module: kernel body -> wrapper (grid, block specs) -> public jitted function -> jnp reference
-> `main()` benchmark. Every kernel takes `interpret=True` to run in the Pallas interpreter (CPU).

GPU backend: all three kernels use the Pallas Triton lowering (the default lowering of
`pl.pallas_call` on CUDA when given `plgpu.CompilerParams` from `jax.experimental.pallas.triton`).
It is deprecated upstream in favour of Mosaic GPU, but it expresses the page gathers (pointer loads
indexed by a page-id vector) directly, runs unchanged in interpret mode, and was measurable within
this project's GPU time; a Mosaic GPU (TMA + wgmma) port is future work. The one place that picks
the lowering is each module's `plgpu.CompilerParams(...)`.
"""
