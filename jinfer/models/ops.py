"""Which implementation computes attention and the MLP inside the forward pass.

`ModelOps` is a static (hashable) argument of `forward`, so each choice compiles its own
executable. The reference ops are plain jnp (XLA: the kernel module's own jnp reference for attention, which
gathers every page of each token's sequence); the Pallas ops call the kernels in
`pallas_kernels/`, natively on GPU or in the Pallas interpreter on CPU (tests).

Kernel choice per shape (static, at trace time), from the H100 measurements in
benchmarks/results/kernels_h100.json:
- attention: one token in the step (batch-1 decode) -> the split-K decode kernel; anything else
  (prefill chunks, decode batches, mixed) -> the ragged prefill kernel, which measured the same
  bandwidth as the decode kernel on decode batches (2.47 vs 2.46 TB/s at 64 x 2k);
- MLP: the fused Pallas kernel only where it beat XLA (`PALLAS_MLP_TOKENS`); XLA's fusion elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jinfer.models.batch import Batch
from jinfer.models.layers import swiglu_mlp

BACKENDS = ("auto", "reference", "pallas")
# Token counts at which the fused Pallas MLP measured faster than XLA on the H100
# (63.7 vs 77.5 us at T=1; slower from T=16 on; T=2..15 not measured).
PALLAS_MLP_TOKENS = frozenset({1})


@dataclass(frozen=True)
class ModelOps:
    backend: str = "reference"  # "reference" | "pallas"
    interpret: bool = False  # Pallas interpreter (CPU)

    def __post_init__(self):
        if self.backend not in ("reference", "pallas"):
            raise ValueError(f"attention_backend={self.backend!r} must be one of {BACKENDS}")

    def attention(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: Batch,
                  scale: float) -> jax.Array:
        """q: [T, H, D] -> [T, H, D], each token over its sequence's pages (K/V already written)."""
        from pallas_kernels.prefill_attention import ragged_prefill_attention, ragged_prefill_attention_reference

        if self.backend == "reference":
            return ragged_prefill_attention_reference(q, k_cache, v_cache, batch.query_start, batch.seq_lens,
                                                      batch.page_table, scale=scale)
        from pallas_kernels.paged_attention import paged_decode_attention

        if q.shape[0] == 1 and batch.num_seqs == 1:
            return paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale=scale,
                                          interpret=self.interpret)
        return ragged_prefill_attention(q, k_cache, v_cache, batch.query_start, batch.seq_lens, batch.page_table,
                                        scale=scale, interpret=self.interpret)

    def mlp(self, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
        if self.backend == "pallas" and x.shape[0] in PALLAS_MLP_TOKENS:
            from pallas_kernels.fused_mlp import fused_swiglu_mlp

            return fused_swiglu_mlp(x, w_gate, w_up, w_down, interpret=self.interpret)
        return swiglu_mlp(x, w_gate, w_up, w_down)


REFERENCE_OPS = ModelOps()


def select_ops(backend: str = "auto", interpret: bool | None = None) -> ModelOps:
    """"auto": the Pallas kernels on GPU, the jnp reference elsewhere. Pallas off-GPU runs interpreted."""
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r} must be one of {BACKENDS}")
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        backend = "pallas" if on_gpu else "reference"
    return ModelOps(backend, (not on_gpu) if interpret is None else interpret)
