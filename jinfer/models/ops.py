"""Which implementation computes attention and the MLP inside the forward pass.

`ModelOps` is a static (hashable) argument of `forward`, so each choice compiles its own
executable. The reference ops are plain jnp (XLA: the kernel module's own jnp reference for attention, which
gathers every page of each token's sequence); the Pallas ops call the kernels in
`pallas_kernels/`, natively on GPU or in the Pallas interpreter on CPU (tests).

Kernel choice per shape (static, at trace time), from the H100 measurements in
benchmarks/results/kernels_h100.json:
- attention: a decode step (every sequence has one new token: batch-1 decode, or an executable the
  runner compiled with `decode_step` for the decode-only steps of a bucket with B = T) -> the
  paged decode kernel; anything else (prefill chunks, mixed steps) -> the ragged prefill kernels,
  split by sequence: those with >= `MOSAIC_MIN_QUERY_LEN` new tokens go to the Mosaic GPU kernel
  (TMA + wgmma, one query head per tile; prefill_attention_mgpu.py), the rest (decodes, short
  chunks) and the padding to the Triton kernel, which packs a kv head's query heads into one tile.
  The ragged kernel reads decode batches at 2.17 TB/s where the decode kernel reaches 2.44 (64 x 2k,
  random pages; `kernels_h100_repeat3.json`), hence the decode-only executables. A step of fewer than
  `MOSAIC_MIN_STEP_TOKENS` tokens never launches the Mosaic kernel;
- MLP: the fused Pallas kernel only where it beat XLA (`PALLAS_MLP_TOKENS`); XLA's fusion elsewhere;
- projections around attention: on one device, steps of <= NORM_QKV_MAX_TOKENS tokens run norm + q|k|v + q/k
  norm + RoPE + the K/V write as one kernel (`norm_qkv_rope_write`); XLA's GEMMs otherwise, and for o (but
  one-token o projections under XLA's strength-reduction size: the skinny GEMM, see `out_proj`).
- mixture-of-experts MLP (`moe_block`): the norm, router matmul and routing as one kernel in small steps
  (pallas_kernels/moe/moe_router.py: `moe_norm_route`), else the router matmul in XLA and the routing kernel; then the
  two grouped GEMMs of pallas_kernels/moe/moe_routing.py and moe_gemm.py over the expert-grouped layout,
  with `moe_block_m` rows per block; the reference is `layers.moe_mlp` (`lax.ragged_dot`).
The layer's norms and residual adds belong to these ops (`qkv`, `out_proj`, `mlp_block`, `moe_block`),
so a fused kernel can take them in; the reference ops are the plain jnp model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jinfer.models.batch import Batch
from jinfer.models.layers import moe_mlp, rms_norm, swiglu, swiglu_mlp

BACKENDS = ("auto", "reference", "pallas", "pallas-triton")  # pallas-triton: no Mosaic GPU kernel
# Sequences with at least this many new tokens in a step take the Mosaic GPU prefill kernel: a full
# tile (2 warpgroups x 64 query rows); shorter ones waste most of the tile's rows.
MOSAIC_MIN_QUERY_LEN = 128
# Steps of fewer tokens never launch it: they are decode batches (<= max_num_seqs tokens) or small
# chunks, where its tile table and launch (~0.1 ms per step over 36 layers) buy nothing.
MOSAIC_MIN_STEP_TOKENS = 512
# Token counts at which the fused Pallas MLP measured faster than XLA on the H100 (63.7 vs 77.5 us at T=1).
# With the partials' padding gone it was still slower at decode batches 8 / 16 / 32 (TPOT 4.44 / 5.13 /
# 7.62 ms against XLA's 4.30 / 4.96 / 6.05; latency_mlp_tokens_*_qwen3-4b_h100.json).
# JINFER_PALLAS_MLP_TOKENS="1,8" overrides it for measurements (part of the executable cache's key).
PALLAS_MLP_TOKENS = frozenset(int(t) for t in os.environ.get("JINFER_PALLAS_MLP_TOKENS", "1").split(",") if t)

# XLA's GPU pipeline rewrites a dot whose left side is one row (a vector once the unit dimension is
# dropped) into a multiply + reduce when the matrix has fewer than 10M elements (its
# DotStrengthReduction pass), and that streams the weights at ~0.8 TB/s instead of ~3: the o projection
# of a tp=2 Qwen3-8B shard (2048 x 4096) or of Qwen3-30B-A3B (4096 x 2048) in a batch-1 decode step.
# `project` gives such dots a second (padding) row, which keeps them GEMMs.
STRENGTH_REDUCED_DOT_ELEMENTS = 10_000_000
PAD_VECTOR_DOTS = True


def project(x: jax.Array, w: jax.Array, **kw) -> jax.Array:
    """x @ w for x [T, K], w [K, N] (`jnp.dot` keywords pass through), kept a GEMM when T = 1."""
    if PAD_VECTOR_DOTS and x.shape[0] == 1 and w.shape[0] * w.shape[1] < STRENGTH_REDUCED_DOT_ELEMENTS:
        return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w, **kw)[:1]
    return jnp.dot(x, w, **kw)


# Steps of at most this many tokens run q/k norm + RoPE + the K/V write as one kernel (qkv_rope.py): at
# decode they are ~8 XLA kernels per layer of ~1.3 us launch latency each. Prefill-sized steps keep XLA's
# fusions, which stream large inputs well.
QKV_ROPE_MAX_TOKENS = 256
# Steps of at most this many tokens (and the kernel's MAX_TOKENS) run the input RMSNorm, the q|k|v projection
# and the above as one kernel (pallas_kernels/dense/norm_qkv_rope.py), where the layer's q|k|v weight is fused (one
# device). JINFER_NORM_QKV_TOKENS overrides it for measurements (part of the executable cache's key).
NORM_QKV_MAX_TOKENS = int(os.environ.get("JINFER_NORM_QKV_TOKENS", "64"))
NORM_QKV_K_SPLITS: int | None = None  # None: the kernel's default_k_splits (measurements patch it)
STEP_COUNTERS = 1024  # ModelOps.step_counters: one per program group (a head of the q|k|v kernel)
# Split-K finished in the kernels' last programs (pallas_kernels/split_k.py) where the step's counters reach them:
# the decode attention's merge, the o projection's split sum + residual add (steps of <= FUSED_O_MAX_TOKENS
# tokens: pallas_kernels/dense/skinny_gemm.py's `skinny_gemm_residual`) and the fused MLP's split sum + residual add.
# Off by default: measured no faster on the H100 (Qwen3-4B decode steps, `local_step_tails_qwen3-4b_h100.json`):
# batch 1 3.99 ms with all three against 3.58 without (the MLP's tail 2419 us a step against 1951 + 76 + 50 us of
# kernel, the merged attention 297 against 204 + 63, o 386 against 334 + 49); batch 8 4.06 against 4.04 (merged
# attention 635 against 577 + 66). The last program's chain, barrier -> atomic ticket -> volatile loads of the
# partials, is two L2 round trips on the critical path, what the XLA kernel it replaces costs; the MLP took one
# per column tile. JINFER_FUSED_TAILS names the ones taken ("merge,o,mlp"; default "none"), JINFER_FUSED_O_TOKENS
# the o projection's step sizes (measurements; part of the executable cache's key).
# The norm_qkv_rope kernel's idle SMs (Qwen3-4B: 96 programs on 132) read the first PREFETCH_O of the layer's o
# projection weight into L2 (evict-last) while it runs, so the o GEMM after attention finds that part in L2
# (`norm_qkv_rope_write`'s `prefetch`). Qwen3-4B decode steps on the H100: 20% saves 11-21 us a step at batch 1 and
# 36-51 at batch 8 (o 9.5 -> 8.2 us a layer, the q|k|v kernel 16.0 -> 17.1); the whole weight made o 6.6 us but the
# q|k|v kernel 35 us (the prefetch programs stream at a fraction of an SM's rate): local_step_prefetch_o*.json.
# JINFER_PREFETCH_O: the fraction (0: off; measurements; part of the executable cache's key).
PREFETCH_O = float(os.environ.get("JINFER_PREFETCH_O", "0.2"))
FUSED_TAILS = frozenset(os.environ.get("JINFER_FUSED_TAILS", "none").split(","))
FUSED_O_MAX_TOKENS = int(os.environ.get("JINFER_FUSED_O_TOKENS", "32"))
# Steps of these token counts run the o projection (GEMV_O_TOKENS) / an XLA MLP's down projection (GEMV_DOWN_TOKENS)
# with its residual add as one Pallas GEMV of GEMV_BLOCK_N-column programs over the whole K range
# (pallas_kernels/dense/skinny_gemm.py's `gemv_residual`: no split-K, no XLA add after it). JINFER_GEMV_O_TOKENS /
# JINFER_GEMV_DOWN_TOKENS ("1,8"; default none) and JINFER_GEMV_BLOCK_N (measurements; part of the cache's key).
GEMV_O_TOKENS = frozenset(int(t) for t in os.environ.get("JINFER_GEMV_O_TOKENS", "").split(",") if t)
GEMV_DOWN_TOKENS = frozenset(int(t) for t in os.environ.get("JINFER_GEMV_DOWN_TOKENS", "").split(",") if t)
GEMV_BLOCK_N = int(os.environ.get("JINFER_GEMV_BLOCK_N", "32"))
# Decode steps of these token counts run the o projection, its residual add and the dense MLP block as one dataflow
# launch (pallas_kernels/persistent.py: the MLP's programs resident and loading weights while the o programs
# finish). JINFER_PERSISTENT_O_MLP_TOKENS="1,8" (measurements; part of the executable cache's key); default none.
PERSISTENT_O_MLP_TOKENS = frozenset(
    int(t) for t in os.environ.get("JINFER_PERSISTENT_O_MLP_TOKENS", "").split(",") if t)


# Steps of at most this many tokens run a MoE block's whole front end, RMSNorm + router + routing, as one kernel
# (moe_router.moe_norm_route, its last program routing: one launch for XLA's ~7 kernels and the routing program).
# Qwen3-30B-A3B decode steps on the H100 (bench_local_step, local_step_front*_qwen3-30b-a3b_h100.json): 3.60-3.63 vs
# 3.89 ms at batch 1, 4.19-4.28 vs 4.31 at 8; slower at 16 (5.23 vs 4.83: one K split there, 8 programs) and 32.
# JINFER_MOE_FRONT_TOKENS overrides it for measurements (part of the executable cache's key).
MOE_FRONT_MAX_TOKENS = int(os.environ.get("JINFER_MOE_FRONT_TOKENS", "8"))
# Steps routing at least this many rows per expert (on average) run the experts on the Mosaic GPU grouped
# GEMM (moe_gemm_mgpu.py: 482 TFLOP/s at 4096 tokens x top-8 on the H100, against 251 for the Triton
# kernels; at 512 and 1024 tokens it was weight-bound at 84-167 TFLOP/s and the Triton kernels were not
# measured there, so they keep those steps). kernels: moe_kernels_h100.json, moe_mgpu_h100.json.
MOSAIC_MOE_MIN_ROWS_PER_EXPERT = 128
MOSAIC_MOE_BLOCK_M = 128


def _front_supported(tokens: int, hidden: int, experts: int) -> bool:
    from pallas_kernels.moe.moe_router import front_supported

    return front_supported(tokens, hidden, experts) is None


def moe_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block of the expert-grouped layout (the grouped GEMMs' M tile): 16 (the smallest
    tensor-core tile) while experts get a few rows each (decode), larger tiles as they fill."""
    per_expert = num_pairs / num_experts
    return 16 if per_expert <= 16 else 64


@dataclass(frozen=True)
class ModelOps:
    backend: str = "reference"  # "reference" | "pallas"
    interpret: bool = False  # Pallas interpreter (CPU)
    mosaic_prefill: bool = False  # long prefill sequences on the Mosaic GPU kernel (see module doc)
    # Set by the runner on the executables of decode-only steps: sequence b's one new token is row b
    # (T == B; padding sequences have seq_len 0), so attention is the paged decode kernel.
    decode_step: bool = False
    # The mesh axis this forward is sharded over (inside `jax.shard_map`, see jinfer/parallel/mesh.py): the
    # ops then hold their device's shards and reduce partial sums across it. None: one device.
    axis: str | None = None

    def __post_init__(self):
        if self.backend not in ("reference", "pallas"):
            raise ValueError(f"attention_backend={self.backend!r} must be one of {BACKENDS}")
        if self.mosaic_prefill:
            # Importing Mosaic GPU points its custom call at the runtime library it resolves its host
            # symbols from (MOSAIC_GPU_RUNTIME_LIB_PATH). An executable loaded from the executable
            # cache is never traced, so without this the first one holding a Mosaic kernel failed to
            # load ("Symbols not found: mosaic_gpu_init_tma_desc") and was recompiled at every start.
            import jax.experimental.mosaic.gpu  # noqa: F401

    def qkv_rope_write(self, qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None, cos: jax.Array,
                       sin: jax.Array, kv: tuple[jax.Array, jax.Array], slot_mapping: jax.Array, num_heads: int,
                       num_kv_heads: int, eps: float, gated_q: bool = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """The fused q|k|v -> (q, k_cache, v_cache) kernel (q/k norm, RoPE or partial RoPE, K/V write;
        `gated_q`: each head's query is followed by its output gate in qkv), or None where the XLA ops are
        used: the reference backend, steps over QKV_ROPE_MAX_TOKENS tokens, other shapes."""
        from pallas_kernels.dense.qkv_rope import check_supported, qkv_rope_write

        if self.backend != "pallas" or qkv.shape[0] > QKV_ROPE_MAX_TOKENS or check_supported(
                qkv.shape[1], num_heads, num_kv_heads, kv[0].shape[-1], gated_q=gated_q,
                rotary_dim=cos.shape[-1]) is not None:
            return None
        return qkv_rope_write(qkv, cos, sin, slot_mapping, q_norm, k_norm, kv[0], kv[1], num_heads=num_heads,
                              num_kv_heads=num_kv_heads, eps=eps, gated_q=gated_q, interpret=self.interpret)

    def step_counters(self, tokens: int) -> jax.Array | None:
        """A step's zeroed int32 counters for the split-K kernels that finish in their last program
        (`norm_qkv_rope_write`, `moe_norm_route`): made once per step (one memset), passed from layer to layer,
        each kernel leaving them zero. None where no kernel takes them."""
        if self.backend != "pallas" or tokens > max(NORM_QKV_MAX_TOKENS, MOE_FRONT_MAX_TOKENS):
            return None
        return jnp.zeros((STEP_COUNTERS,), jnp.int32)

    def norm_qkv_rope_write(self, x: jax.Array, norm: jax.Array, wqkv: jax.Array, q_norm: jax.Array | None,
                            k_norm: jax.Array | None, cos: jax.Array, sin: jax.Array, kv: tuple[jax.Array, jax.Array],
                            slot_mapping: jax.Array, num_heads: int, num_kv_heads: int, eps: float,
                            counters: jax.Array | None = None, prefetch: jax.Array | None = None
                            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None] | None:
        """rms_norm(x) @ wqkv, then what `qkv_rope_write` does, in one kernel -> (q, k_cache, v_cache, counters);
        None where the separate ops are used: the reference backend, steps over NORM_QKV_MAX_TOKENS tokens, other
        shapes (partial RoPE, ...). With `counters` (`step_counters`) each head's K range is split over programs.
        `prefetch` (the layer's o weight) is read into L2 by the launch's idle SMs where PREFETCH_O is on."""
        from pallas_kernels.dense.norm_qkv_rope import check_supported, norm_qkv_rope_write
        from pallas_kernels.dense.prefetch import prefetch_view

        if self.backend != "pallas" or x.shape[0] > NORM_QKV_MAX_TOKENS or check_supported(
                x.shape[0], x.shape[1], wqkv.shape[1], num_heads, num_kv_heads, kv[0].shape[-1],
                cos.shape[-1]) is not None:
            return None
        if not PREFETCH_O or self.axis is not None or prefetch is None or prefetch_view(prefetch) is None:
            prefetch = None
        return norm_qkv_rope_write(x, norm, wqkv, cos, sin, slot_mapping, q_norm, k_norm, kv[0], kv[1], counters,
                                   num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                                   k_splits=NORM_QKV_K_SPLITS, prefetch=prefetch,
                                   prefetch_fraction=PREFETCH_O or 1.0, interpret=self.interpret)

    def attention(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: Batch,
                  scale: float) -> jax.Array:
        """q: [T, H, D] -> [T, H, D], each token over its sequence's pages (K/V already written)."""
        from pallas_kernels.attention.prefill_attention import ragged_prefill_attention, ragged_prefill_attention_reference

        if self.backend == "reference":
            return ragged_prefill_attention_reference(q, k_cache, v_cache, batch.query_start, batch.seq_lens,
                                                      batch.page_table, scale=scale)
        from pallas_kernels.attention.paged_attention import paged_decode_attention

        if self.decode_step and q.shape[0] != batch.num_seqs:
            raise ValueError(f"a decode step needs one token per sequence: {q.shape[0]} tokens, "
                             f"{batch.num_seqs} sequences")
        if self.decode_step or (q.shape[0] == 1 and batch.num_seqs == 1):
            return paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, scale=scale,
                                          interpret=self.interpret)
        args = (q, k_cache, v_cache, batch.query_start, batch.seq_lens, batch.page_table)
        if not self.mosaic_prefill or q.shape[0] < MOSAIC_MIN_STEP_TOKENS:
            return ragged_prefill_attention(*args, scale=scale, interpret=self.interpret)
        from pallas_kernels.attention.prefill_attention_mgpu import (
            check_supported,
            long_sequences,
            ragged_prefill_attention_mgpu,
        )

        if check_supported(q, k_cache) is not None:
            return ragged_prefill_attention(*args, scale=scale, interpret=self.interpret)
        # The Mosaic kernel writes the long sequences' rows; the Triton kernel then fills in the rest
        # of the same buffer (in place).
        out = ragged_prefill_attention_mgpu(*args, scale=scale, min_query_len=MOSAIC_MIN_QUERY_LEN,
                                            interpret=self.interpret)
        rest = ~long_sequences(batch.query_start, MOSAIC_MIN_QUERY_LEN)
        return ragged_prefill_attention(*args, rest, out, scale=scale, interpret=self.interpret)

    def _paged_decode(self, q: jax.Array, batch: Batch) -> bool:
        """Whether `attention` takes the paged decode kernel for this step."""
        return self.backend == "pallas" and (self.decode_step or (q.shape[0] == 1 and batch.num_seqs == 1))

    def attention_counted(self, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, batch: Batch, scale: float,
                          counters: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
        """`attention`, passing the step's counters (`step_counters`) on: (out, counters). With them a decode step's
        split-K partials are merged in the attention kernel, by each (sequence, kv head)'s last split (no merge
        kernel)."""
        if counters is not None and "merge" in FUSED_TAILS and self._paged_decode(q, batch) \
                and q.shape[0] == batch.num_seqs and counters.shape[0] >= batch.num_seqs * k_cache.shape[2]:
            from pallas_kernels.attention.paged_attention import paged_decode_attention

            return paged_decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, counters,
                                          scale=scale, interpret=self.interpret)
        return self.attention(q, k_cache, v_cache, batch, scale), counters

    def norm_projections(self, x: jax.Array, norm: jax.Array, weights: tuple[jax.Array, ...],
                         eps: float) -> tuple[jax.Array, ...]:
        """rms_norm(x) @ w for each w; x: [T, hidden] (the residual stream).

        XLA's kernels (decode-sized steps with a fused q|k|v weight take `norm_qkv_rope_write` instead). An
        earlier norm + q/k/v kernel with 32-column tiles ran at ~1 TB/s at T=1 on the H100; the one kept
        owns whole heads and splits K (see `pallas_kernels/dense/norm_qkv_rope.py`).
        """
        h = rms_norm(x, norm, eps)
        return tuple(project(h, w) for w in weights)

    def gated_delta_rule(self, q, k, v, g, beta, states, slots, fresh, query_start, out_dtype=jnp.float32,
                         packed_k_heads: int | None = None):
        """Gated DeltaNet's recurrence over the ragged batch, each sequence from / to its state slot
        (pallas_kernels/linear_attention/gated_delta_rule.py). Pallas: sequences of >= 64 new rows in chunks (tensor-core
        matmuls), the others on the recurrent kernel, both writing their rows of one output in out_dtype;
        decode steps the recurrent kernel only. packed_k_heads: q holds q|k|v, k = v = None (the conv output
        as is, no slices copied out: gated_delta_rule.head_views). Returns (o [T, Hv, Dv] in out_dtype, the
        updated state pool)."""
        from pallas_kernels.linear_attention.gated_delta_rule import gated_delta_rule

        return gated_delta_rule(q, k, v, g, beta, states, slots, fresh, query_start, backend=self.backend,
                                interpret=self.interpret, chunked=not self.decode_step, out_dtype=out_dtype,
                                packed_k_heads=packed_k_heads)

    def gated_delta_decode(self, proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions, fresh, *,
                           num_k_heads: int, key_dim: int, value_dim: int, b_col: int, a_col: int, z_col: int,
                           norm_weight: jax.Array, eps: float):
        """A Gated DeltaNet layer's conv, gates, delta rule and gated RMSNorm for a step of one new row per
        sequence (row b is sequence b's, at `positions[b]`), from its input projection `proj` (q | k | v at
        [0, conv_dim), z at z_col, b and a at b_col, a_col): (o [B, Hv, Dv] in proj's dtype, normalised and
        gated; conv pool; state pool). Pallas: one fused kernel (pallas_kernels/linear_attention/gated_delta_rule_decode.py);
        reference: the same formulas in jnp."""
        from pallas_kernels.linear_attention.gated_delta_rule_decode import decode_reference, fused_decode_step

        dims = dict(num_k_heads=num_k_heads, key_dim=key_dim, value_dim=value_dim, b_col=b_col, a_col=a_col,
                    z_col=z_col, norm_weight=norm_weight, eps=eps)
        args = (proj, conv_state, conv_w, a_log, dt_bias, states, slots, positions, fresh)
        if self.decode_step and proj.shape[0] != slots.shape[0]:
            raise ValueError(f"a decode step has one row per sequence: {proj.shape[0]} rows, {slots.shape[0]} seqs")
        if self.backend == "pallas":
            return fused_decode_step(*args, **dims, interpret=self.interpret)
        return decode_reference(*args, **dims)

    def causal_conv(self, x, conv_state, weight, seq, starts, query_start, slots, positions):
        """Qwen3.5's depthwise causal conv + SiLU over a ragged batch from each sequence's conv ring, and the rings'
        update, for the first C = weight.shape[0] columns of x [T, W] (the layer's input projection: read in
        place): (y [T, C], the pool). Pallas: y from one kernel (pallas_kernels/linear_attention/causal_conv.py; C a multiple of
        128); reference: the kernel's jnp reference. The rings' update in XLA either way."""
        from pallas_kernels.linear_attention.causal_conv import causal_conv, causal_conv_reference, ring_update

        C = weight.shape[0]
        if self.backend != "pallas" or C % 128:
            return causal_conv_reference(x, conv_state, weight, seq, starts, query_start, slots, positions)
        y = causal_conv(x, conv_state, weight, seq, starts, slots, positions, interpret=self.interpret)
        return y, ring_update(x[:, :C], conv_state, slots, query_start, positions)

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

    def reduce(self, partial: jax.Array) -> jax.Array:
        """The sum of the devices' partial results of a row-parallel matmul (identity on one device)."""
        return partial if self.axis is None else jax.lax.psum(partial, self.axis)

    def embed(self, table: jax.Array, ids: jax.Array, vocab_size: int) -> jax.Array:
        """table[ids]; a vocab-parallel table (this device's rows of `vocab_size`) looks up the ids in its
        range, zeros elsewhere, and the psum assembles the rows."""
        if table.shape[0] == vocab_size:
            return table[ids]
        rows = table.shape[0]
        local = ids - jax.lax.axis_index(self.axis) * rows
        hit = (local >= 0) & (local < rows)
        return self.reduce(jnp.where(hit[:, None], table[jnp.clip(local, 0, rows - 1)], 0))

    def lm_head(self, x: jax.Array, head: jax.Array, vocab_size: int) -> jax.Array:
        """x @ head in float32 -> [N, vocab]; a vocab-parallel head's columns are gathered."""
        logits = project(x, head, preferred_element_type=jnp.float32)
        if head.shape[1] == vocab_size:
            return logits
        return jax.lax.all_gather(logits, self.axis, axis=1, tiled=True)

    def out_proj(self, attn: jax.Array, wo: jax.Array, residual: jax.Array) -> jax.Array:
        """residual + attn @ wo.

        A one-token step whose o weight is small enough for XLA's strength reduction (which `project` defeats with
        a padding row: one more kernel, since attention's output comes from a Pallas call) takes the Pallas skinny
        GEMM instead. Qwen3-30B-A3B's 4096 x 2048 o at batch 1 on the H100: decode step 3.535 / 3.556 vs 3.615 /
        3.588 ms in interleaved rounds (`local_step_skinny_o_qwen3-30b-a3b_h100.json`); on Qwen3-4B's unpadded
        4096 x 2560 o, and at batch 8, the two were even, so those keep XLA's GEMM."""
        if self._gemv_residual(attn, wo, GEMV_O_TOKENS):
            from pallas_kernels.dense.skinny_gemm import gemv_residual

            return gemv_residual(attn, wo, residual, block_n=GEMV_BLOCK_N, interpret=self.interpret)
        if self.backend == "pallas" and attn.shape[0] == 1 and PAD_VECTOR_DOTS \
                and wo.shape[0] * wo.shape[1] < STRENGTH_REDUCED_DOT_ELEMENTS and wo.shape[0] % 16 == 0 \
                and wo.shape[1] % 16 == 0:
            from pallas_kernels.dense.skinny_gemm import skinny_gemm

            return residual + self.reduce(skinny_gemm(attn, wo, interpret=self.interpret).astype(attn.dtype))
        return residual + self.reduce(project(attn, wo))

    def out_proj_counted(self, attn: jax.Array, wo: jax.Array, residual: jax.Array, counters: jax.Array | None
                         ) -> tuple[jax.Array, jax.Array | None]:
        """`out_proj`, passing the step's counters on: (residual + attn @ wo, counters). With them a step of <=
        FUSED_O_MAX_TOKENS tokens on one device runs as one kernel, the skinny GEMM whose last program per column
        block sums the K splits and adds the residual (no XLA sum and add kernels after it)."""
        if counters is not None and "o" in FUSED_TAILS and self.backend == "pallas" and self.axis is None \
                and attn.shape[0] <= FUSED_O_MAX_TOKENS and wo.shape[0] % 16 == 0 and wo.shape[1] % 16 == 0:
            from pallas_kernels.dense.skinny_gemm import MAX_TOKENS, default_config, skinny_gemm_residual

            if attn.shape[0] <= MAX_TOKENS and wo.shape[1] // default_config(*wo.shape)["block_n"] <= counters.shape[0]:
                return skinny_gemm_residual(attn, wo, residual, counters, interpret=self.interpret)
        return self.out_proj(attn, wo, residual), counters

    def mlp_block_counted(self, x: jax.Array, norm: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                          w_down: jax.Array, eps: float, counters: jax.Array | None
                          ) -> tuple[jax.Array, jax.Array | None]:
        """`mlp_block`, passing the step's counters on: (x + mlp(rms_norm(x)), counters). With them, where the fused
        Pallas MLP runs (one device), its split-K sum and the residual add happen in the kernel's last programs."""
        if counters is not None and "mlp" in FUSED_TAILS and self.axis is None and self._pallas_mlp(x, w_gate) \
                and x.shape[0] <= 64:
            from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp_block, pow2_divisor

            if x.shape[1] // pow2_divisor(x.shape[1], 256) <= counters.shape[0]:
                return fused_swiglu_mlp_block(x, norm, w_gate, w_up, w_down, counters, eps=eps,
                                              interpret=self.interpret)
        return self.mlp_block(x, norm, w_gate, w_up, w_down, eps), counters

    def persistent_o_mlp(self, tokens: int, ko: int, hidden: int, inter: int, counters: jax.Array | None,
                         layer: int) -> bool:
        """Whether a dense layer's o projection + MLP block run as `out_proj_mlp_block` in this step."""
        if not (self.backend == "pallas" and self.axis is None and tokens in PERSISTENT_O_MLP_TOKENS
                and counters is not None and counters.shape[0] - 1 - layer >= STEP_COUNTERS // 2):
            return False
        from pallas_kernels.dense.fused_mlp import pow2_divisor
        from pallas_kernels.persistent import check_supported, max_waiting

        return check_supported(tokens, ko, hidden, inter) is None \
            and (self.interpret or inter // pow2_divisor(inter, 128) <= max_waiting())

    def out_proj_mlp_block(self, attn: jax.Array, wo: jax.Array, residual: jax.Array, norm: jax.Array,
                           w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, eps: float, counters: jax.Array,
                           layer: int) -> tuple[jax.Array, jax.Array]:
        """x1 = residual + attn @ wo; (x1 + mlp(rms_norm(x1)), counters) as one launch (`persistent_o_mlp` says
        where); layer i uses the step's counter STEP_COUNTERS - 1 - i (each launch its own: no reset)."""
        from pallas_kernels.persistent import o_proj_mlp_block

        return o_proj_mlp_block(attn, wo, residual, norm, w_gate, w_up, w_down, counters, eps=eps,
                                slot=counters.shape[0] - 1 - layer, interpret=self.interpret)

    def _gemv_residual(self, x: jax.Array, w: jax.Array, tokens: frozenset) -> bool:
        """Whether x @ w + a residual runs as `gemv_residual` (one device, the token count in `tokens`)."""
        if not (self.backend == "pallas" and self.axis is None and x.shape[0] in tokens):
            return False
        from pallas_kernels.dense.skinny_gemm import MAX_TOKENS

        return x.shape[0] <= MAX_TOKENS and x.shape[1] % 16 == 0 and w.shape[1] % GEMV_BLOCK_N == 0

    def _pallas_mlp(self, x: jax.Array, w_gate: jax.Array) -> bool:
        return self.backend == "pallas" and x.shape[0] in PALLAS_MLP_TOKENS and x.shape[1] % 16 == 0 \
            and w_gate.shape[1] % 16 == 0

    def mlp_block(self, x: jax.Array, norm: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                  eps: float) -> jax.Array:
        """x + mlp(rms_norm(x)); x: [T, hidden] (the residual stream).

        (Folding the residual add before the block into the fused kernel, x + delta added as the kernel reads
        x, was measured: it removed one ~1.5 us XLA kernel per layer but slowed the kernel by ~3.7 us per
        layer at batch-1 decode on the H100, 1885 vs 1767 us per Qwen3.5-4B step: the extra load sits on each
        K iteration's critical path. See docs/ARCHITECTURE.md.)"""
        if self._pallas_mlp(x, w_gate):
            from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp

            return x + self.reduce(fused_swiglu_mlp(x, w_gate, w_up, w_down, norm, eps=eps,
                                                    interpret=self.interpret))
        if self._gemv_residual(x, w_down, GEMV_DOWN_TOKENS):
            from pallas_kernels.dense.skinny_gemm import gemv_residual

            return gemv_residual(swiglu(rms_norm(x, norm, eps), w_gate, w_up), w_down, x, block_n=GEMV_BLOCK_N,
                                 interpret=self.interpret)
        return x + self.reduce(swiglu_mlp(rms_norm(x, norm, eps), w_gate, w_up, w_down))

    def moe_block(self, x: jax.Array, norm: jax.Array, router: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                  w_down: jax.Array, *, top_k: int, renormalize: bool, eps: float, counters: jax.Array | None = None
                  ) -> tuple[jax.Array, jax.Array | None]:
        """(x + moe(rms_norm(x)), counters); x: [T, hidden]; router: [hidden, E]; experts stacked [E, ...].
        counters: the step's (`step_counters`), passed on; with them a small step's norm, router and routing are
        one kernel (`moe_norm_route`).

        Sharded (`axis`), the experts here are this device's: their intermediate columns (tensor
        parallel) or, when there are fewer of them than the router's E, experts [e0, e0 + E_local)
        (expert parallel). Every device routes every token; the psum adds the partial outputs.
        """
        num_experts, hidden, inter = w_gate.shape
        tokens = x.shape[0]
        first = None  # expert parallel: the id of this device's first expert
        if num_experts != router.shape[1]:
            first = jax.lax.axis_index(self.axis) * num_experts
        kernels = self.backend == "pallas" and hidden % 16 == 0 and inter % 16 == 0
        routing = None
        if kernels and counters is not None and tokens <= MOE_FRONT_MAX_TOKENS \
                and _front_supported(tokens, hidden, router.shape[1]):
            from pallas_kernels.moe.moe_router import moe_norm_route

            h, routing, counters = moe_norm_route(x, norm, router, counters, top_k=top_k, renormalize=renormalize,
                                                  block_m=moe_block_m(tokens * top_k, router.shape[1]), eps=eps,
                                                  interpret=self.interpret)
        else:
            h = rms_norm(x, norm, eps)
            # router logits rounded to the activation dtype, as HF's F.linear (and vLLM) produce them
            logits = project(h, router, preferred_element_type=jnp.float32).astype(h.dtype)  # [T, E]
        if not kernels:
            return x + self.reduce(moe_mlp(h, logits, w_gate, w_up, w_down, top_k, renormalize, first)), counters
        from pallas_kernels.moe.moe_gemm import moe_combine, moe_down, moe_gate_up
        from pallas_kernels.moe.moe_routing import local_experts, moe_route

        if routing is None and self.mosaic_prefill and tokens * top_k >= MOSAIC_MOE_MIN_ROWS_PER_EXPERT * logits.shape[1]:
            out = self._moe_mgpu(h, logits, w_gate, w_up, w_down, top_k, renormalize, first)
            if out is not None:
                return x + self.reduce(out), counters
        if routing is None:
            routing = moe_route(logits, top_k=top_k, renormalize=renormalize,
                                block_m=moe_block_m(tokens * top_k, logits.shape[1]), interpret=self.interpret)
        mine = None
        if first is not None:
            routing, mine = local_experts(routing, first, num_experts)
        act = moe_gate_up(h, routing, w_gate, w_up, interpret=self.interpret)
        y = moe_down(act, routing, w_down, interpret=self.interpret)
        return x + self.reduce(moe_combine(y, top_k, x.dtype, mine)), counters

    def _moe_mgpu(self, h, logits, w_gate, w_up, w_down, top_k, renormalize, first):
        """The experts on the Mosaic GPU grouped GEMM (`moe_experts_mgpu`); None where the kernel does not
        take the shapes."""
        from pallas_kernels.moe.moe_gemm_mgpu import check_supported, moe_experts_mgpu
        from pallas_kernels.moe.moe_routing import local_experts, moe_route

        bm = MOSAIC_MOE_BLOCK_M
        up_spec = jax.ShapeDtypeStruct((bm, h.shape[1]), h.dtype)
        down_spec = jax.ShapeDtypeStruct((bm, w_down.shape[1]), h.dtype)
        if check_supported(up_spec, w_gate, w_up, block_m=bm) is not None \
                or check_supported(down_spec, w_down, block_m=bm) is not None:
            return None
        routing = moe_route(logits, top_k=top_k, renormalize=renormalize, block_m=bm, interpret=self.interpret)
        mine = None
        if first is not None:
            routing, mine = local_experts(routing, first, w_gate.shape[0])
        return moe_experts_mgpu(h, routing, w_gate, w_up, w_down, mine=mine, interpret=self.interpret)


REFERENCE_OPS = ModelOps()


def select_ops(backend: str = "auto", interpret: bool | None = None) -> ModelOps:
    """"auto": the Pallas kernels on GPU, the jnp reference elsewhere. Pallas off-GPU runs interpreted.

    The Mosaic GPU prefill kernel is on for "pallas" when compiled for the GPU; "pallas-triton" and
    interpret mode (its interpreter is far slower) keep every prefill on the Triton kernel.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend={backend!r} must be one of {BACKENDS}")
    on_gpu = jax.default_backend() == "gpu"
    if backend == "auto":
        backend = "pallas" if on_gpu else "reference"
    interpret = (not on_gpu) if interpret is None else interpret
    mosaic = backend == "pallas" and not interpret
    return ModelOps("pallas" if backend == "pallas-triton" else backend, interpret, mosaic)
