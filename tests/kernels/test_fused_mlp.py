"""fused_swiglu_mlp vs its jnp reference (XLA's own fusion)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.fp8 import quantize
from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp, fused_swiglu_mlp_reference
from tests.kernels.conftest import MODES, assert_close, by_mode, lower_for_cuda

# The w8a8 cases on the GPU: on the H100 they differed from the reference by up to 0.08 (outputs ~1) while the
# interpreter agrees to 2e-5, most likely because XLA's GPU pipeline folded the reference's e4m3 round trip away
# (fake_quant_rows now keeps it behind an optimization barrier); expected failures there until a GPU run says.
W8A8_GPU = "w8a8 vs its reference on the GPU: 0.08 apart on the H100 before the reference kept its e4m3 rounding"

# (tokens, hidden, intermediate, dtype, block_i, RMSNorm prologue: None / unrolled / looped, FP8 scale block or None)
CASES = [
    pytest.param(1, 128, 256, jnp.float32, None, None, None, id="t1-f32"),
    pytest.param(5, 128, 384, jnp.float32, 64, None, None, id="t5-f32-bi64"),
    pytest.param(40, 256, 512, jnp.bfloat16, None, None, None, id="t40-bf16"),
    pytest.param(70, 160, 256, jnp.bfloat16, 32, None, None, id="t70-bf16-hidden160-2tiles"),
    # FP8 weights: 128 x 128 blocks (one scale per tile, as real checkpoints), and blocks narrower than the tiles'
    # columns and not dividing the dims (a scale per column, partial last blocks), in float32 (tight tolerance)
    pytest.param(1, 256, 256, jnp.bfloat16, None, True, (128, 128), id="t1-bf16-fp8-b128-norm"),
    pytest.param(3, 160, 96, jnp.float32, None, None, (64, 48), id="t3-f32-fp8-b64x48"),
]
# The interpreter (one compile per case) also runs the norm prologue on two of them (test_mlp_with_norm_prologue on
# the GPU): unrolled on t5 (f32, block_i 64), looped on t40 (bf16, the default block_i).
INTERPRET_CASES = [CASES[0], pytest.param(*CASES[1].values[:-2], True, None, id="t5-f32-bi64-norm-unrolled"),
                   pytest.param(*CASES[2].values[:-2], False, None, id="t40-bf16-norm-looped"), *CASES[3:]]


def _weight(rng, shape, dtype, scale_block):
    """A random [in, out] weight: in `dtype`, or block-FP8 (values, scales)."""
    w = jnp.asarray(rng.standard_normal(shape) * shape[0]**-0.5, dtype)
    if scale_block is None:
        return w, None
    q = quantize(w.astype(jnp.float32), scale_block)
    return q.w, q.scale


@pytest.mark.parametrize("mode,tokens,hidden,inter,dtype,block_i,unroll_norm,scale_block",
                         by_mode(INTERPRET_CASES, CASES))
def test_mlp_matches_reference(mode, tokens, hidden, inter, dtype, block_i, unroll_norm, scale_block):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * (1 if unroll_norm is None else 4), dtype)
    (wg, sg), (wu, su), (wd, sd) = (_weight(rng, shape, dtype, scale_block)
                                    for shape in ((hidden, inter), (hidden, inter), (inter, hidden)))
    scales = None if scale_block is None else (sg, su, sd)
    norm = {} if unroll_norm is None else dict(
        norm_weight=jnp.asarray(1 + 0.2 * rng.standard_normal(hidden), dtype), eps=1e-5, unroll_norm=unroll_norm)
    out = fused_swiglu_mlp(x, wg, wu, wd, norm.get("norm_weight"), scales, scale_block=scale_block,
                           eps=norm.get("eps", 1e-6), unroll_norm=norm.get("unroll_norm", True), block_i=block_i,
                           interpret=mode == "interpret")
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = fused_swiglu_mlp_reference(x, wg, wu, wd, norm.get("norm_weight"), scales, scale_block=scale_block,
                                     eps=norm.get("eps", 1e-6))
    assert_close(out, ref, dtype, mode)


@pytest.mark.parametrize("mode", [m for m in MODES if m.id == "gpu"])  # interpreter: test_mlp_matches_reference
@pytest.mark.parametrize("unroll_norm", [True, False])
def test_mlp_with_norm_prologue(mode, unroll_norm):
    rng = np.random.default_rng(3)
    tokens, hidden, inter, dtype = 3, 128, 256, jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 4, dtype)
    wg, wu = (jnp.asarray(rng.standard_normal((hidden, inter)) * hidden**-0.5, dtype) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((inter, hidden)) * inter**-0.5, dtype)
    g = jnp.asarray(1 + 0.2 * rng.standard_normal(hidden), dtype)
    out = fused_swiglu_mlp(x, wg, wu, wd, g, eps=1e-5, unroll_norm=unroll_norm, interpret=mode == "interpret")
    assert_close(out, fused_swiglu_mlp_reference(x, wg, wu, wd, g, eps=1e-5), dtype, mode)


def test_mlp_argument_checks():
    x = jnp.zeros((4, 64))
    w = jnp.zeros((64, 128))
    with pytest.raises(ValueError, match="w_down"):
        fused_swiglu_mlp(x, w, w, jnp.zeros((64, 128)), interpret=True)
    with pytest.raises(ValueError, match="w_gate"):
        fused_swiglu_mlp(x, jnp.zeros((32, 128)), w, jnp.zeros((128, 64)), interpret=True)
    with pytest.raises(ValueError, match="block_i"):
        fused_swiglu_mlp(x, w, w, jnp.zeros((128, 64)), block_i=48, interpret=True)
    q, qd = quantize(w, (32, 32)), quantize(jnp.zeros((128, 64)), (32, 32))
    with pytest.raises(ValueError, match="needs its scales"):
        fused_swiglu_mlp(x, q.w, q.w, qd.w, interpret=True)
    with pytest.raises(ValueError, match="scale must be"):
        fused_swiglu_mlp(x, q.w, q.w, qd.w, None, (q.scale, q.scale, q.scale), scale_block=(32, 32), interpret=True)
    with pytest.raises(ValueError, match="scale blocks' height"):
        fused_swiglu_mlp(x, q.w, q.w, qd.w, None, (q.scale, q.scale, qd.scale), scale_block=(32, 32), block_i=64,
                         interpret=True)


def test_fp8_lowers_for_the_gpu():
    """The e4m3 loads and their conversion lower through Pallas' Triton lowering (Qwen3-8B's shapes, 128 x 128
    blocks); the interpreter cannot tell."""
    f8, f32, h, i = jnp.float8_e4m3fn, jnp.float32, 4096, 12288
    s = jax.ShapeDtypeStruct
    text = lower_for_cuda(lambda x, n, g, u, d, sc: fused_swiglu_mlp(x, g, u, d, n, sc, scale_block=(128, 128)),
                          s((1, h), jnp.bfloat16), s((h,), jnp.bfloat16), s((h, i), f8), s((h, i), f8), s((i, h), f8),
                          (s((32, 96), f32), s((32, 96), f32), s((96, 32), f32)))
    assert "fused_swiglu_mlp_t16_i128_norm_fp8" in text


# FP8 tiles against the activations other than by conversion to x's dtype (fp8_tiles.act_operand): f16 dots (bf16
# tolerance), and w8a8 (activations FP8-quantized per row and 128 columns) against the reference that quantizes them
# alike (float32 tolerance: the same FP8 values, a different summation order).
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,dtype,fp8_mode", [
    pytest.param(2, jnp.float32, "w8a8", id="t2-f32-w8a8"),
])
def test_mlp_fp8_modes(mode, tokens, dtype, fp8_mode, request):
    if mode == "gpu" and fp8_mode == "w8a8":
        request.applymarker(pytest.mark.xfail(reason=W8A8_GPU, strict=False))
    rng = np.random.default_rng(7)
    hidden, inter, block = 256, 256, (128, 128)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 4, dtype)
    (wg, sg), (wu, su), (wd, sd) = (_weight(rng, shape, dtype, block)
                                    for shape in ((hidden, inter), (hidden, inter), (inter, hidden)))
    norm = jnp.asarray(1 + 0.2 * rng.standard_normal(hidden), dtype)
    out = fused_swiglu_mlp(x, wg, wu, wd, norm, (sg, su, sd), scale_block=block, eps=1e-5, fp8_mode=fp8_mode,
                           interpret=mode == "interpret")
    ref = fused_swiglu_mlp_reference(x, wg, wu, wd, norm, (sg, su, sd), scale_block=block, eps=1e-5,
                                     fp8_mode=fp8_mode)
    assert_close(out, ref, dtype, mode)
    if fp8_mode == "w8a8":  # and within FP8 rounding of the bf16-activation result
        plain = fused_swiglu_mlp_reference(x, wg, wu, wd, norm, (sg, su, sd), scale_block=block, eps=1e-5)
        np.testing.assert_allclose(np.asarray(out), np.asarray(plain), atol=0.15, rtol=0.15)
