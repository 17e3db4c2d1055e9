"""Block-FP8 routed experts of a large MoE step on FP8 tensor cores: the grouped form of the Mosaic GPU e4m3 GEMM
(pallas_kernels/dense/fp8_gemm_mgpu.py, `block_expert`), as moe_gemm_mgpu.py runs bf16 experts.

The routing's expert-sorted layout in blocks of 128 rows (the GEMM's CTA tile) takes x's rows gathered by XLA (TMA
wants each expert's rows contiguous); gate and up are two grouped GEMMs over the same rows (each quantizes them to
e4m3 per token and 128 columns: one XLA fusion after CSE), SwiGLU and the down projection's row quantization are XLA
fusions, and the down rows are gathered back per (token, slot), weighted and summed (`moe_gemm.moe_combine`). Unused
blocks (expert -1) cost a scalar read per tile; padding rows inside a block are computed and never read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.dense.fp8_gemm_mgpu import cta_tile, fp8_gemm_mgpu

BLOCK_M = cta_tile("m")[0]  # the routing's block: the GEMM's CTA rows


def supported(hidden: int, inter: int, block: tuple[int, int]) -> bool:
    """Whether experts of these dims (this device's share) and FP8 scale block fit the grouped GEMM: 128 x 128 blocks,
    both dims whole 128-wide tiles."""
    return tuple(block) == (128, 128) and hidden % 128 == 0 and inter % 128 == 0


def moe_experts_fp8_mgpu(x: jax.Array, routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                         scales: tuple[jax.Array, jax.Array, jax.Array], *, mine: jax.Array | None = None,
                         interpret: bool = False) -> jax.Array:
    """The routed experts' weighted sum [T, hidden] of the normed rows x [T, hidden].

    Args:
      routing: `moe_routing.MoeRouting` in blocks of BLOCK_M rows.
      w_gate, w_up: float8_e4m3fn [E, intermediate, hidden]; w_down [E, hidden, intermediate] ([out, in]:
        `Fp8Weight.transposed`); scales: theirs, [E, in / 128, out / 128] float32.
      mine: [T, k] the pairs whose experts are here (expert parallelism, `moe_routing.local_experts`).
    """
    from pallas_kernels.moe.moe_gemm import moe_combine

    if routing.block_m != BLOCK_M:
        raise ValueError(f"routing.block_m={routing.block_m} must be {BLOCK_M} (the grouped GEMM's CTA rows)")
    top_k, m = routing.top_k, routing.sorted_pairs.shape[0]
    valid = jnp.arange(m, dtype=jnp.int32) % BLOCK_M < jnp.repeat(routing.block_rows, BLOCK_M, total_repeat_length=m)
    rows = x[jnp.where(valid, routing.sorted_pairs // top_k, 0)]  # [M, hidden] expert-sorted rows
    gemm = functools.partial(fp8_gemm_mgpu, block_expert=routing.block_expert, out_dtype=x.dtype, interpret=interpret)
    g, u = gemm(rows, w_gate, scales[0]), gemm(rows, w_up, scales[1])  # [M, I] each
    act = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
    ys = gemm(act, w_down, scales[2])  # [M, hidden]
    y = ys[routing.pair_rows.reshape(-1)] * routing.topk_weights.reshape(-1, 1).astype(ys.dtype)  # [T*k, hidden]
    return moe_combine(y, top_k, x.dtype, mine)
