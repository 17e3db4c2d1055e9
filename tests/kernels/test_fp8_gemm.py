"""fp8_gemm (block-FP8 weights, activations quantized per row and 128 columns, e4m3 dots) vs its jnp reference on the
same quantized operands, and vs the exact matmul on the dequantized weights within FP8's rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.fp8 import dequantize, quantize
from pallas_kernels.dense.fp8_gemm import (
    check_supported,
    default_config,
    fp8_gemm,
    fp8_gemm_reference,
    quantize_rows,
)
from tests.kernels.conftest import assert_close, by_mode, lower_for_cuda

# e4m3 keeps 3 mantissa bits: each activation is rounded by up to 1/16 of itself (~3.6% RMS), so the output moves by
# ~3.6% of its RMS against the unquantized activations' matmul (measured 0.026-0.029 here).
FP8_REL_RMS = 0.05

# (M, K, N, x dtype, scale block, launch overrides, swiglu (w_up), w transposed)
B = (128, 128)
INTERPRET = [
    pytest.param(24, 256, 256, jnp.float32, B, {}, False, False, id="m24-defaults"),
    pytest.param(40, 256, 384, jnp.bfloat16, B, {"block_m": 16, "group_m": 2}, False, False, id="m40-ragged-bf16"),
    pytest.param(24, 256, 256, jnp.float32, B, {"block_n": 64}, True, False, id="m24-swiglu-n64"),
    pytest.param(17, 256, 256, jnp.float32, B, {}, False, True, id="m17-nk"),
    pytest.param(5, 64, 96, jnp.float32, (16, 16), {}, False, False, id="m5-blocks16"),  # the tiny checkpoints' blocks
    # compressed-tensors per-channel scales (blocks of 128 x 1: a scale per column, gathered per tile)
    pytest.param(20, 256, 96, jnp.float32, (128, 1), {}, False, False, id="m20-per-column"),
]
# Qwen3-8B's projections (hidden 4096, intermediate 12288, q|k|v 4096 + 2 x 1024 out) at prefill sizes
GPU = [pytest.param(m, k, n, jnp.bfloat16, B, {}, swiglu, nk, id=f"{name}-m{m}" + ("-nk" if nk else ""))
       for m in (512, 4096) for name, k, n, swiglu, nk in (("qkv", 4096, 6144, False, False),
                                                           ("o", 4096, 4096, False, False),
                                                           ("gate_up", 4096, 12288, True, False),
                                                           ("down", 12288, 4096, False, False),
                                                           ("o", 4096, 4096, False, True))]
GPU.append(pytest.param(1000, 4096, 6144, jnp.bfloat16, B, {}, False, False, id="qkv-m1000-ragged"))


def _weights(rng, k, n, block, swiglu):
    ws = [quantize(jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, jnp.float32), block) for _ in range(1 + swiglu)]
    return ws[0], (ws[1] if swiglu else None)


@pytest.mark.parametrize("mode,m,k,n,dtype,block,kw,swiglu,nk", by_mode(INTERPRET, GPU))
def test_fp8_gemm_matches_reference(mode, m, k, n, dtype, block, kw, swiglu, nk):
    rng = np.random.default_rng(m + n)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w, up = _weights(rng, k, n, block, swiglu)
    extra = {} if up is None else {"w_up": up.w, "w_up_scale": up.scale}
    if nk:
        extra = {k_: (v.T if k_ == "w_up" else v) for k_, v in extra.items()}
    out = fp8_gemm(x, w.w.T if nk else w.w, w.scale, scale_block=block, **extra, w_transposed=nk,
                   interpret=mode == "interpret", **kw)
    assert out.shape == (m, n) and out.dtype == dtype
    group = kw.get("block_k") or default_config(m, k, n, block)["block_k"]
    ref_up = {} if up is None else {"w_up": up.w, "w_up_scale": up.scale}
    ref = fp8_gemm_reference(x, w.w, w.scale, scale_block=block, group=group, **ref_up)
    assert_close(out, ref, dtype, mode)

    # against the exact matmul with unquantized activations: FP8's rounding of x only
    xf = x.astype(jnp.float32)
    exact = xf @ dequantize(w)
    if up is not None:
        exact = jax.nn.silu(exact) * (xf @ dequantize(up))
    got, exact = np.asarray(out.astype(jnp.float32)), np.asarray(exact)
    rel = np.sqrt(np.mean((got - exact) ** 2) / np.mean(exact**2))
    assert rel < FP8_REL_RMS, rel


def test_quantize_rows_matches_numpy():
    """Per row and group: scale amax / 448 (0 for a zero group), values x / scale rounded to e4m3 (ml_dtypes)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 64)).astype(np.float32) * np.array([[1.0], [300.0], [0.0]], np.float32)
    q, s = quantize_rows(jnp.asarray(x), 32)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (2, 3) and s.dtype == jnp.float32
    amax = np.abs(x.reshape(3, 2, 32)).max(-1)  # [rows, groups]
    np.testing.assert_allclose(np.asarray(s).T, amax / 448, rtol=1e-6)
    inv = np.where(amax > 0, 448 / np.where(amax > 0, amax, 1), 0)
    want = (x.reshape(3, 2, 32) * inv[..., None]).astype(jnp.float8_e4m3fn).reshape(3, 64)
    np.testing.assert_array_equal(np.asarray(q).astype(np.float32), want.astype(np.float32))
    assert np.abs(np.asarray(q).astype(np.float32)).max() <= 448 and not np.asarray(q[2]).astype(np.float32).any()


def test_fp8_gemm_argument_checks():
    q = quantize(jnp.ones((256, 256)), B)
    x = jnp.ones((8, 256), jnp.bfloat16)
    with pytest.raises(ValueError, match="share K"):
        fp8_gemm(jnp.ones((8, 128)), q.w, q.scale, scale_block=B, interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        fp8_gemm(x, q.w, q.scale, scale_block=B, block_n=96, interpret=True)
    with pytest.raises(ValueError, match="block_k"):
        fp8_gemm(x, q.w, q.scale, scale_block=B, block_k=256, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        fp8_gemm(x, q.w, q.scale[:1], scale_block=B, interpret=True)
    with pytest.raises(ValueError, match="w_up goes with"):
        fp8_gemm(x, q.w, q.scale, w_up=q.w, scale_block=B, interpret=True)
    with pytest.raises(ValueError, match="x_scale"):
        fp8_gemm(x.astype(jnp.float8_e4m3fn), q.w, q.scale, scale_block=B, interpret=True)
    assert check_supported(4096, 6144, B) is None
    assert "too small" in check_supported(64, 96, (16, 16)) and check_supported(64, 96, (16, 16), gpu=False) is None
    assert "multiple of 16" in check_supported(256, 40, B)


def test_default_config():
    assert default_config(24, 256, 256, B)["block_m"] == 32  # (one tile: no rows past the next power of two)
    c = default_config(4096, 4096, 6144, B)
    assert (c["block_m"], c["block_n"], c["block_k"], c["num_warps"]) == (128, 128, 128, 8)
    assert default_config(512, 12288, 4096, B)["block_m"] == 64 and default_config(4096, 64, 96, (16, 16))[
        "block_k"] == 16


@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_fp8_gemm_lowers_for_the_gpu(swiglu):
    """Qwen3-8B's q|k|v (or gate|up with its SwiGLU) at 4096 tokens through Pallas' Triton lowering: e4m3 tt.dot."""
    s = jax.ShapeDtypeStruct
    w, sc = s((4096, 6144), jnp.float8_e4m3fn), s((32, 48), jnp.float32)

    def fn(x, w, sc, *up):
        return fp8_gemm(x, w, sc, scale_block=B, **dict(zip(("w_up", "w_up_scale"), up)))

    text = lower_for_cuda(fn, s((4096, 4096), jnp.bfloat16), w, sc, *((w, sc) if swiglu else ()))
    assert "fp8_gemm_m128_n128_k128" + ("_swiglu" if swiglu else "") in text
