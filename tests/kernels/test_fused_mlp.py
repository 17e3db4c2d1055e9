"""fused_swiglu_mlp vs its jnp reference (XLA's own fusion)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.fp8 import quantize
from pallas_kernels.dense.fp8_tiles import dequantize
from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp, fused_swiglu_mlp_reference, narrow_block_i
from tests.kernels.conftest import MODES, assert_close, by_mode, lower_for_cuda

# (tokens, hidden, intermediate, dtype, block_i, RMSNorm prologue: None / unrolled / looped, FP8 scale block or None)
CASES = [
    pytest.param(1, 128, 256, jnp.float32, None, None, None, id="t1-f32"),
    pytest.param(5, 128, 384, jnp.float32, 64, None, None, id="t5-f32-bi64"),
    pytest.param(40, 256, 512, jnp.bfloat16, None, None, None, id="t40-bf16"),
    pytest.param(70, 160, 256, jnp.bfloat16, 32, None, None, id="t70-bf16-hidden160-2tiles"),
    # FP8 weights (e4m3 activations, against the reference quantizing them alike): 128 x 128 blocks (one scale per
    # tile, as real checkpoints), and blocks narrower than the tiles' columns and not dividing the dims (a scale per
    # column, partial last blocks), in float32 (tight tolerance: the same FP8 values, another summation order)
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


def rel_rms(a, b) -> float:
    a, b = (np.asarray(v, np.float32) for v in (a, b))
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


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
    kernel_w = (wg, wu, wd) if scale_block is None else (wg.T, wu.T, wd.T)  # (FP8: [out, in])
    out = fused_swiglu_mlp(x, *kernel_w, norm.get("norm_weight"), scales, scale_block=scale_block,
                           eps=norm.get("eps", 1e-6), unroll_norm=norm.get("unroll_norm", True), block_i=block_i,
                           interpret=mode == "interpret")
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = fused_swiglu_mlp_reference(x, wg, wu, wd, norm.get("norm_weight"), scales, scale_block=scale_block,
                                     eps=norm.get("eps", 1e-6))
    assert_close(out, ref, dtype, mode)
    if scale_block is not None:  # and within the activations' FP8 rounding (~3% a value) of unquantized ones
        dq = (dequantize(w, s_, scale_block) for w, s_ in zip((wg, wu, wd), scales, strict=True))
        plain = fused_swiglu_mlp_reference(x, *dq, norm.get("norm_weight"), eps=norm.get("eps", 1e-6))
        rel = rel_rms(out, plain)  # relative RMS 0.035 (bf16, 128 x 128) / 0.043 (f32, 64 x 48): bounded at ~2x
        assert 1e-3 < rel < 0.1, rel


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


def test_narrow_block_i():
    """Shared experts' widths get enough programs (DeepSeek-V2-Lite's 2816: 88; Qwen3.5-35B-A3B's 512: 16, the 32-column
    floor); a width that already has them keeps the 128 of the dense MLP's sweep."""
    assert [narrow_block_i(i) for i in (2816, 512, 9728, 12288, 10944)] == [32, 32, 128, 128, 64]


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
    fp8_w = (q.w.T, q.w.T, qd.w.T)  # ([out, in])
    with pytest.raises(ValueError, match="scale must be"):
        fused_swiglu_mlp(x, *fp8_w, None, (q.scale, q.scale, q.scale), scale_block=(32, 32), interpret=True)
    with pytest.raises(ValueError, match="must divide the FP8 scale blocks"):
        fused_swiglu_mlp(x, *fp8_w, None, (q.scale, q.scale, qd.scale), scale_block=(32, 32), block_i=64,
                         interpret=True)
    with pytest.raises(ValueError, match="tiles_per_step"):
        fused_swiglu_mlp(x, *fp8_w, None, (q.scale, q.scale, qd.scale), scale_block=(32, 32), tiles_per_step=4,
                         interpret=True)


def test_fp8_lowers_for_the_gpu():
    """The e4m3 loads, the activations' quantization and the FP8 dots lower through Pallas' Triton lowering
    (Qwen3-8B's shapes, [out, in] weights in 128 x 128 blocks, two K tiles a step); the interpreter cannot tell."""
    f8, f32, h, i = jnp.float8_e4m3fn, jnp.float32, 4096, 12288
    s = jax.ShapeDtypeStruct
    text = lower_for_cuda(lambda x, n, g, u, d, sc: fused_swiglu_mlp(x, g, u, d, n, sc, scale_block=(128, 128),
                                                                     tiles_per_step=2),
                          s((8, h), jnp.bfloat16), s((h,), jnp.bfloat16), s((i, h), f8), s((i, h), f8), s((h, i), f8),
                          (s((32, 96), f32), s((32, 96), f32), s((96, 32), f32)))
    assert "fused_swiglu_mlp_t16_i128_norm_fp8_nk2" in text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,norm,per", [(1, True, 1), (20, False, 2)])
def test_fp8_weights_as_checkpoints_store_them(mode, tokens, norm, per):
    """Qwen3-8B's FP8 layout at small size (128 x 128 blocks, the norm prologue, one and two K tiles a step) over
    one token and over two token tiles (20 tokens): the reference's values (the same FP8 values and e4m3
    activations, another summation order)."""
    rng = np.random.default_rng(7)
    hidden, inter, block = 256, 384, (128, 128)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 4, jnp.float32)
    ws = [_weight(rng, shape, jnp.float32, block) for shape in ((hidden, inter), (hidden, inter), (inter, hidden))]
    scales = tuple(s_ for _, s_ in ws)
    g = jnp.asarray(1 + 0.2 * rng.standard_normal(hidden), jnp.float32) if norm else None
    out = fused_swiglu_mlp(x, *(w.T for w, _ in ws), g, scales, scale_block=block, tiles_per_step=per, block_t=16,
                           interpret=mode == "interpret")
    ref = fused_swiglu_mlp_reference(x, *(w for w, _ in ws), g, scales, scale_block=block)
    if mode == "interpret":
        assert_close(out, ref, jnp.float32, mode)
    else:  # an activation at an e4m3 rounding boundary may round the other way on the GPU (another amax / 448
        # arithmetic): one code's step (~6%) in a term, so the bound is on the largest difference
        err = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
        assert err < 2e-2, err
