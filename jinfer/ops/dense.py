"""The dense ops' kernel choices: projections, the attention block's front end (norm + q|k|v + RoPE + K/V write),
the o projection, the dense MLP block, embedding and lm_head.

- projections around attention: on one device, steps of <= norm_qkv_max_tokens tokens run norm + q|k|v + q/k
  norm + RoPE + the K/V write as one kernel (`norm_qkv_rope_write`, which also prefetches part of the o weight into
  L2); otherwise XLA's GEMMs, then q/k norm + RoPE + K/V write as one kernel up to qkv_rope_max_tokens. o runs on
  XLA's GEMM (but one-token o projections under XLA's strength-reduction size: the skinny GEMM, see `out_proj`).
- MLP: the fused Pallas kernel at the token counts where it beat XLA (`KernelPolicy.pallas_mlp_tokens`), XLA's
  fusion elsewhere.
The layer's norms and residual adds belong to these ops, so a fused kernel can take them in.

Block-FP8 weights (`Fp8Weight`): these three kernels read them (values and scales, `fp8_operands`) and meet them with
the activations quantized to e4m3 per row and K tile (pallas_kernels/dense/fp8_tiles.py); steps past fp8_max_tokens run
every projection on the Mosaic GPU e4m3 GEMM (`_fp8_gemm`); where neither can (a mix of FP8 and plain weights, scale
blocks under 16 rows or not 128 x 128 in large steps, no Mosaic GPU) the jnp path dequantizes (`refuse_fp8`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jinfer.models.fp8 import dense, is_fp8, refuse_fp8
from jinfer.models.layers import rms_norm, swiglu_mlp

# XLA's GPU pipeline rewrites a dot whose left side is one row (a vector once the unit dimension is dropped) into a
# multiply + reduce when the matrix has fewer than 10M elements (its DotStrengthReduction pass), and that streams
# the weights at ~0.8 TB/s instead of ~3: the o projection of a tp=2 Qwen3-8B shard (2048 x 4096) or of
# Qwen3-30B-A3B (4096 x 2048) in a batch-1 decode step. `project` gives such dots a second (padding) row.
STRENGTH_REDUCED_DOT_ELEMENTS = 10_000_000
STEP_COUNTERS = 1024  # DenseOps.step_counters: one per program group (a head of the q|k|v kernel)


def project(x: jax.Array, w: jax.Array, pad_vector_dots: bool = True, **kw) -> jax.Array:
    """x @ w for x [T, K], w [K, N] (`jnp.dot` keywords pass through), kept a GEMM when T = 1 (pad_vector_dots).
    An FP8 weight (`jinfer.models.fp8.Fp8Weight`) is dequantized per block to x's dtype first."""
    w = dense(w, x.dtype)
    if pad_vector_dots and x.shape[0] == 1 and w.shape[0] * w.shape[1] < STRENGTH_REDUCED_DOT_ELEMENTS:
        return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w, **kw)[:1]
    return jnp.dot(x, w, **kw)


def fp8_operands(kernel: str, *weights, transposed: bool = False
                 ) -> tuple[tuple, tuple | None, tuple[int, int] | None] | None:
    """What a kernel that reads block-FP8 weights takes: (values, scales, scale block) where every weight is FP8 in
    one block shape of >= 16 rows (a kernel's K tile divides it) and in the kernel's layout (`transposed`: [out, in],
    fp8.kernel_layout), (weights, None, None) where none is FP8, None where the kernel cannot take them
    (`refuse_fp8` logs it; the caller takes the jnp path)."""
    if not any(is_fp8(w) for w in weights):
        return weights, None, None
    block = getattr(weights[0], "block", None)
    if not all(is_fp8(w) and w.block == block and w.transposed == transposed for w in weights) or block[0] % 16:
        refuse_fp8(kernel, *weights)
        return None
    return tuple(w.w for w in weights), tuple(w.scale for w in weights), block


class DenseOps:
    """ModelOps' dense ops (mixed into `jinfer.ops.ModelOps`, whose fields they read)."""

    def _fp8_gemm(self, tokens: int, *weights) -> bool:
        """Whether a step of `tokens` runs these weights on the Mosaic GPU block-FP8 GEMM (pallas_kernels/dense/
        fp8_gemm_mgpu.py): steps past fp8_max_tokens (smaller ones take the decode kernels) where Mosaic kernels are
        on, every weight block-FP8 [out, in] in 128 x 128 blocks with both sides multiples of 128. Elsewhere large
        steps dequantize for XLA's GEMM."""
        return (self.backend == "pallas" and self.mosaic_prefill and tokens > self.policy.fp8_max_tokens
                and all(is_fp8(w) and w.transposed and tuple(w.block) == (128, 128)
                        and w.w.shape[0] % 128 == 0 and w.w.shape[1] % 128 == 0 for w in weights))

    def fp8_gemm(self, x: jax.Array, w) -> jax.Array:
        """x @ w for a block-FP8 w ([out, in]) on the Mosaic GPU GEMM (`_fp8_gemm` says where), in x's dtype."""
        from pallas_kernels.dense.fp8_gemm_mgpu import fp8_gemm_mgpu

        return fp8_gemm_mgpu(x, w.w, w.scale, scale_block=tuple(w.block), out_dtype=x.dtype, interpret=self.interpret)

    def project(self, x: jax.Array, w: jax.Array, skinny: bool = True, **kw) -> jax.Array:
        """x @ w, kept a GEMM at T = 1 where the policy pads vector dots (`project`); a block-FP8 w in a large step on
        the FP8 GEMM (`_fp8_gemm`), in a step of <= fp8_max_tokens on the skinny GEMM (`_fp8_skinny`; not `skinny`:
        dequantized, `out_proj`'s choice where the policy declines the kernel)."""
        if not kw and self._fp8_gemm(x.shape[0], w):
            return self.fp8_gemm(x, w)
        if skinny and (out := self._fp8_skinny(x, w, kw)) is not None:
            return out
        return project(x, w, self.policy.pad_vector_dots, **kw)

    def _fp8_skinny(self, x: jax.Array, w, kw: dict) -> jax.Array | None:
        """x @ w on the skinny GEMM (pallas_kernels/dense/skinny_gemm.py) for a block-FP8 w kept [out, in] (fp8.
        kernel_layout: a draft head's projections and lm_head, q|k|v where no fused kernel takes it) in a step of <=
        fp8_max_tokens, in `preferred_element_type` (else x's dtype); None elsewhere (the jnp path dequantizes the
        whole weight every step, ~3x the bytes)."""
        if not (is_fp8(w) and w.transposed and self.backend == "pallas" and set(kw) <= {"preferred_element_type"}
                and x.shape[0] <= self.policy.fp8_max_tokens and w.w.shape[0] % 16 == 0 and w.w.shape[1] % 16 == 0):
            return None
        from pallas_kernels.dense.skinny_gemm import MAX_TOKENS, skinny_gemm

        if x.shape[0] > MAX_TOKENS or (operands := fp8_operands("skinny_gemm", w, transposed=True)) is None:
            return None
        (values,), (scale,), block = operands
        out = skinny_gemm(x, values, scale, scale_block=block, interpret=self.interpret)
        return out.astype(kw.get("preferred_element_type") or x.dtype)

    def step_counters(self, tokens: int) -> jax.Array | None:
        """A step's zeroed int32 counters for the split-K kernels that finish in their last program
        (`norm_qkv_rope_write`, `moe_norm_route`): made once per step (one memset), passed from layer to layer,
        each kernel leaving them zero. None where no kernel takes them."""
        policy = self.policy
        if self.backend != "pallas" or tokens > max(policy.norm_qkv_max_tokens, policy.moe_front_max_tokens):
            return None
        return jnp.zeros((STEP_COUNTERS,), jnp.int32)

    def qkv_rope_write(self, qkv: jax.Array, q_norm: jax.Array | None, k_norm: jax.Array | None, cos: jax.Array,
                       sin: jax.Array, kv: tuple[jax.Array, ...], slot_mapping: jax.Array, num_heads: int,
                       num_kv_heads: int, eps: float, gated_q: bool = False
                       ) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """The fused q|k|v -> (q, k_cache, v_cache) kernel (q/k norm, RoPE or partial RoPE, K/V write;
        `gated_q`: each head's query is followed by its output gate in qkv), or None where the XLA ops are
        used: the reference backend, steps over qkv_rope_max_tokens tokens, other shapes. `kv`: the layer's cache,
        (k, v) or FP8's (k, v, k_scale, v_scale) (the rows quantized as they are written)."""
        if self.backend != "pallas" or qkv.shape[0] > self.policy.qkv_rope_max_tokens:
            return None
        from pallas_kernels.dense.qkv_rope import check_supported, qkv_rope_write

        if check_supported(qkv.shape[1], num_heads, num_kv_heads, kv[0].shape[-1], gated_q=gated_q,
                           rotary_dim=cos.shape[-1]) is not None:
            return None
        return qkv_rope_write(qkv, cos, sin, slot_mapping, q_norm, k_norm, *kv, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, eps=eps, gated_q=gated_q, interpret=self.interpret)

    def norm_qkv_rope_write(self, x: jax.Array, norm: jax.Array, wqkv: jax.Array, q_norm: jax.Array | None,
                            k_norm: jax.Array | None, cos: jax.Array, sin: jax.Array, kv: tuple[jax.Array, ...],
                            slot_mapping: jax.Array, num_heads: int, num_kv_heads: int, eps: float,
                            counters: jax.Array | None = None, prefetch: jax.Array | None = None
                            ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None] | None:
        """rms_norm(x) @ wqkv, then what `qkv_rope_write` does, in one kernel -> (q, k_cache, v_cache, counters);
        None where the separate ops are used: the reference backend, steps over norm_qkv_max_tokens tokens, other
        shapes (partial RoPE, ...). With `counters` (`step_counters`) each head's K range is split over programs.
        `prefetch` (the layer's o weight) is read into L2 by the launch's idle SMs where prefetch_o is on."""
        policy = self.policy
        if self.backend != "pallas" or x.shape[0] > policy.norm_qkv_max_tokens:
            return None
        operands = fp8_operands("norm_qkv_rope", wqkv, transposed=True)  # (FP8: [out, in], fp8.kernel_layout)
        if operands is None:
            return None
        w_kn = wqkv  # (the logical [in, out] shape, for the checks)
        (wqkv,), scales, block = operands
        from pallas_kernels.dense.norm_qkv_rope import check_supported, norm_qkv_rope_write
        from pallas_kernels.dense.prefetch import prefetch_view

        if check_supported(x.shape[0], x.shape[1], w_kn.shape[1], num_heads, num_kv_heads, kv[0].shape[-1],
                           cos.shape[-1]) is not None:
            return None
        if is_fp8(prefetch):  # the o weight's FP8 values (its scales are a few KB; their layout does not matter)
            prefetch = prefetch.w
        if not policy.prefetch_o or self.axis is not None or prefetch is None or prefetch_view(prefetch) is None:
            prefetch = None
        return norm_qkv_rope_write(x, norm, wqkv, cos, sin, slot_mapping, q_norm, k_norm, kv[0], kv[1], counters,
                                   num_heads=num_heads, num_kv_heads=num_kv_heads, eps=eps,
                                   k_splits=policy.norm_qkv_k_splits, prefetch=prefetch,
                                   prefetch_fraction=policy.prefetch_o or 1.0,
                                   prefetch_eviction=policy.prefetch_eviction,
                                   wqkv_scale=None if scales is None else scales[0], scale_block=block,
                                   **dict(zip(("k_scale", "v_scale"), kv[2:])),
                                   interpret=self.interpret, **policy.launch_args("norm_qkv_rope"))

    def norm_projections(self, x: jax.Array, norm: jax.Array, weights: tuple[jax.Array, ...],
                         eps: float) -> tuple[jax.Array, ...]:
        """rms_norm(x) @ w for each w; x: [T, hidden] (the residual stream).

        XLA's kernels (decode-sized steps with a fused q|k|v weight take `norm_qkv_rope_write` instead). An
        earlier norm + q/k/v kernel with 32-column tiles ran at ~1 TB/s at T=1 on the H100; the one kept
        owns whole heads and splits K (see `pallas_kernels/dense/norm_qkv_rope.py`).
        """
        h = rms_norm(x, norm, eps)
        return tuple(self.project(h, w) for w in weights)

    def out_proj(self, attn: jax.Array, wo: jax.Array, residual: jax.Array) -> jax.Array:
        """residual + attn @ wo.

        A one-token step whose o weight is small enough for XLA's strength reduction (which `project` defeats with
        a padding row: one more kernel, since attention's output comes from a Pallas call) takes the Pallas skinny
        GEMM instead. Qwen3-30B-A3B's 4096 x 2048 o at batch 1 on the H100: decode step 3.535 / 3.556 vs 3.615 /
        3.588 ms in interleaved rounds (`local_step_skinny_o_qwen3-30b-a3b_h100.json`); on Qwen3-4B's unpadded
        4096 x 2560 o, and at batch 8, the two were even, so those keep XLA's GEMM.

        An FP8 o weight ([out, in]: fp8.kernel_layout) takes the skinny GEMM at one token whatever its size where
        `KernelPolicy.fp8_skinny_o` (the alternative is not XLA's plain GEMM but a dequantization and a GEMM), and at
        up to fp8_max_tokens."""
        policy = self.policy
        tokens = attn.shape[0]
        small = wo.shape[0] * wo.shape[1] < STRENGTH_REDUCED_DOT_ELEMENTS and policy.pad_vector_dots
        fp8 = is_fp8(wo) and (tokens == 1 and policy.fp8_skinny_o or 1 < tokens <= policy.fp8_max_tokens)
        if self.backend == "pallas" and (tokens == 1 and small or fp8) \
                and wo.shape[0] % 16 == 0 and wo.shape[1] % 16 == 0 \
                and (operands := fp8_operands("skinny_gemm", wo, transposed=True)) is not None:
            from pallas_kernels.dense.skinny_gemm import skinny_gemm

            (w,), scales, block = operands  # (FP8: [out, in], fp8.kernel_layout)
            out = skinny_gemm(attn, w, None if scales is None else scales[0], scale_block=block,
                              interpret=self.interpret)
            return residual + self.reduce(out.astype(attn.dtype))
        return residual + self.reduce(self.project(attn, wo, skinny=False))

    def mlp_block(self, x: jax.Array, norm: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                  eps: float) -> jax.Array:
        """x + mlp(rms_norm(x)); x: [T, hidden] (the residual stream).

        (Folding the residual add before the block into the fused kernel, x + delta added as the kernel reads
        x, was measured: it removed one ~1.5 us XLA kernel per layer but slowed the kernel by ~3.7 us per
        layer at batch-1 decode on the H100, 1885 vs 1767 us per Qwen3.5-4B step: the extra load sits on each
        K iteration's critical path.)"""
        out = self._fused_mlp(x, norm, w_gate, w_up, w_down, eps, x.shape[0] in self.policy.pallas_mlp_tokens)
        if out is None:
            out = swiglu_mlp(rms_norm(x, norm, eps), w_gate, w_up, w_down)
        return x + self.reduce(out)

    def swiglu(self, h: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
        """The SwiGLU MLP of rows already normed (a MoE block's shared experts; a partial sum when sharded) on the fused
        kernel where `mlp_block` takes it (block-FP8 weights in steps of <= fp8_max_tokens, which it reads; bf16 ones in
        steps of `pallas_mlp_tokens`), else XLA's fusion. (At one token XLA turns the three dots into multiplies and
        reductions: DeepSeek-V2-Lite's shared experts, 35 MB, took ~52 us a layer of a batch-1 step, the kernel 19.)"""
        out = self._fused_mlp(h, None, w_gate, w_up, w_down, 1e-6, h.shape[0] in self.policy.pallas_mlp_tokens,
                              narrow=True)
        return swiglu_mlp(h, w_gate, w_up, w_down) if out is None else out

    def _fused_mlp(self, x, norm, w_gate, w_up, w_down, eps, plain: bool, narrow: bool = False) -> jax.Array | None:
        """The fused SwiGLU kernel's output (its RMSNorm prologue where `norm` is given), or None where XLA's path
        runs: the kernel takes block-FP8 weights in steps of <= fp8_max_tokens (the jnp path would dequantize them),
        plain ones where `plain`. Larger steps with block-FP8 weights run gate, up and down on the e4m3 GEMM
        (`_fp8_gemm`), SwiGLU between them in XLA. `narrow` (shared experts): plain weights in `narrow_block_i`'s
        blocks, whatever the policy's launch for the dense MLP says."""
        if self._fp8_gemm(x.shape[0], w_gate, w_up, w_down):
            h = x if norm is None else rms_norm(x, norm, eps)
            act = jax.nn.silu(self.fp8_gemm(h, w_gate).astype(jnp.float32)) * self.fp8_gemm(h, w_up)
            return self.fp8_gemm(act.astype(x.dtype), w_down)
        fp8 = is_fp8(w_gate) and x.shape[0] <= self.policy.fp8_max_tokens
        if self.backend != "pallas" or not (plain or fp8) or x.shape[1] % 16 or w_gate.shape[1] % 16 \
                or (operands := fp8_operands("fused_mlp", w_gate, w_up, w_down, transposed=True)) is None:
            return None
        from pallas_kernels.dense.fused_mlp import fits_tiles_per_step, fused_swiglu_mlp, narrow_block_i

        (wg, wu, wd), scales, block = operands
        launch = self.policy.launch_args("fused_mlp")
        if narrow and scales is None:
            launch["block_i"] = narrow_block_i(wg.shape[1])
        if scales is not None:  # (Qwen3-8B at 1 / 8 tokens on the H200: two K tiles a step, decode_mlp_fp8_swap_h200)
            launch = {"tiles_per_step": 2 if fits_tiles_per_step(x.shape[1], block, 2) else 1} | launch
        return fused_swiglu_mlp(x, wg, wu, wd, norm, scales, scale_block=block, eps=eps, interpret=self.interpret,
                                **launch)

    def reduce(self, partial: jax.Array) -> jax.Array:
        """The sum of the devices' partial results of a row-parallel matmul (identity on one device)."""
        if self.axis is None:
            return partial
        if self._one_shot(partial, self.policy.all_reduce_limit(jax.local_device_count())):
            from pallas_kernels import all_reduce

            return all_reduce.one_shot_all_reduce(partial, self.axis)
        return jax.lax.psum(partial, self.axis)

    def _one_shot(self, x: jax.Array, limit: int) -> bool:
        """Whether this device's part x of a collective goes to our one-shot kernels (pallas_kernels/all_reduce.py):
        compiled for GPUs, the forward traced with their workspace, x within `limit` bytes and the kernels' sizes."""
        if self.backend != "pallas" or self.interpret or x.size * x.dtype.itemsize > limit:
            return False
        from pallas_kernels import all_reduce

        return all_reduce.active() and all_reduce.supported(x.shape, x.dtype)

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
        logits = self.project(x, head, preferred_element_type=jnp.float32)
        if head.shape[1] == vocab_size:
            return logits
        if self._one_shot(logits, self.policy.one_shot_all_gather_bytes):
            from pallas_kernels import all_reduce

            return all_reduce.one_shot_all_gather(logits, self.axis)
        return jax.lax.all_gather(logits, self.axis, axis=1, tiled=True)
