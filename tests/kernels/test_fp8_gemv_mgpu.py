"""fp8_gemv_mgpu (Mosaic GPU: TMA ring + FP8 wgmma, block-FP8 weights [N, K]) vs its jnp reference and vs the
unquantized product. "interpret" runs jax's Mosaic GPU interpreter on CPU; "gpu" compiles for Hopper. A CPU test
lowers the kernel for CUDA at Qwen3-8B's shapes (Mosaic GPU's layout inference, TMA legality, SMEM)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.fp8 import quantize
from pallas_kernels.dense.fp8_gemv_mgpu import default_config, fp8_gemv_mgpu, fp8_gemv_reference
from pallas_kernels.dense.fp8_tiles import dequantize
from tests.kernels.conftest import by_mode, normal

CASES = [  # tokens, K, N, launch
    pytest.param(1, 512, 256, {"k_splits": 2, "max_steps": 2}, id="t1-split2"),
    pytest.param(9, 256, 128, {"block_n": 64, "max_steps": 3}, id="t9-n64"),
    pytest.param(5, 256, 256, {"w8a16": True, "max_steps": 2}, id="t5-w8a16"),
]
GPU_CASES = CASES + [pytest.param(16, 4096, 4096, {}, id="t16-o"), pytest.param(3, 12288, 4096, {}, id="t3-down"),
                     pytest.param(1, 4096, 12288, {"w8a16": True}, id="t1-gate-w8a16")]


@pytest.mark.parametrize("mode,tokens,k,n,launch", by_mode(CASES, GPU_CASES))
def test_fp8_gemv_mgpu_matches_reference(mode, tokens, k, n, launch):
    rng = np.random.default_rng(tokens + k + n)
    # blocks of magnitudes 2^-4 .. 2^4 apart: each K step's product must meet its own block's scale
    spread = jnp.repeat(jnp.repeat(jnp.asarray(2.0 ** rng.integers(-4, 5, (k // 128, n // 128)), jnp.float32), 128, 0),
                        128, 1)
    q = quantize(normal(rng, (k, n), scale=k**-0.5) * spread, (128, 128))
    w = jnp.asarray(q.w.T)  # [N, K], as checkpoints store it
    x = normal(rng, (tokens, k), jnp.bfloat16)
    if tokens > 1:
        x = x.at[-1].set(0)  # a zero row (a padded token) stays zero
    out = fp8_gemv_mgpu(x, w, q.scale, interpret=mode == "interpret", **launch)
    assert out.shape == (tokens, n) and out.dtype == jnp.float32
    w8a16 = launch.get("w8a16", False)
    ref = fp8_gemv_reference(x, w, q.scale, w8a16)
    # (the GPU's FP8 wgmma keeps fewer accumulator bits within a 128-wide K step than fp32: a looser bound there)
    tol = 1e-4 if mode == "interpret" else 2e-3
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=tol, atol=tol * float(jnp.max(jnp.abs(ref))))
    if tokens > 1:
        assert not np.any(np.asarray(out[-1]))
    # against the unquantized rows: the e4m3 rounding of the activations (3 mantissa bits), as a relative RMS; w8a16:
    # the product of the bf16 rows, as exact as fp32 sums
    full = x.astype(jnp.float32) @ dequantize(q.w, q.scale, (128, 128))
    rel = float(jnp.sqrt(jnp.mean((out - full) ** 2) / jnp.mean(full**2)))
    assert rel < 1e-5 if w8a16 else 1e-3 < rel < 0.06, rel


def test_fp8_gemv_mgpu_lowers_for_cuda():
    """Exporting for CUDA runs Mosaic GPU's own compile steps (the interpreter does not) at Qwen3-8B's o, gate|up
    and down shapes, with the default launches (down with bf16 rows and the tiles converted in registers)."""
    from jax import export

    s = jax.ShapeDtypeStruct
    for n, k, tokens, w8a16 in ((4096, 4096, 1, False), (24576, 4096, 16, False), (4096, 12288, 8, True)):
        fn = jax.jit(lambda x, w, sc, w8a16=w8a16: fp8_gemv_mgpu(x, w, sc, w8a16=w8a16))
        exp = export.export(fn, platforms=["cuda"])(s((tokens, k), jnp.bfloat16), s((n, k), jnp.float8_e4m3fn),
                                                    s((k // 128, n // 128), jnp.float32))
        assert "mosaic_gpu" in exp.mlir_module()
        assert exp.out_avals[0].shape == (tokens, n)


def test_fp8_gemv_mgpu_defaults_and_checks():
    assert default_config(4096, 4096) == {"block_n": 128, "k_splits": 4, "max_steps": 6}  # 32 x 4 CTAs
    assert default_config(4096, 24576)["k_splits"] == 1  # 192 CTAs already
    assert default_config(4096, 4096, w8a16=True) == {"block_n": 64, "k_splits": 2, "max_steps": 6}
    w = jnp.zeros((256, 512), jnp.float8_e4m3fn)
    scale = jnp.ones((4, 2), jnp.float32)
    x = jnp.zeros((1, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="tokens|x must be"):
        fp8_gemv_mgpu(jnp.zeros((17, 512), jnp.bfloat16), w, scale, interpret=True)
    with pytest.raises(ValueError, match="k_splits"):
        fp8_gemv_mgpu(x, w, scale, k_splits=8, interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        fp8_gemv_mgpu(x, w, scale, block_n=256, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        fp8_gemv_mgpu(x, w, jnp.ones((4, 3), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="128 x 128"):
        fp8_gemv_mgpu(x, w, scale, scale_block=(64, 64), interpret=True)


@pytest.mark.parametrize("mode", ["w8a8", "w8a16"])
def test_ops_take_it_for_fp8_decode_steps(mode):
    """With KernelPolicy.fp8_mosaic_gemv (and Mosaic kernels allowed), a decode step's q|k|v (after XLA's norm; the
    fused norm + q|k|v kernel steps aside), o projection and MLP (norm, gate, up, SwiGLU, down) with block-FP8
    [out, in] weights run on this kernel: the jnp path's results (weights dequantized, activations unquantized)
    within the rows' e4m3 rounding."""
    from jinfer.config.kernels import KernelPolicy
    from jinfer.models.fp8 import transpose
    from jinfer.ops import ModelOps

    hidden, inter, tokens = 128, 256, 3
    rng = np.random.default_rng(0)
    wg, wu = (transpose(quantize(normal(rng, (hidden, inter), scale=hidden**-0.5), (128, 128))) for _ in range(2))
    wd, wo = (transpose(quantize(normal(rng, s, scale=s[0]**-0.5), (128, 128))) for s in ((inter, hidden),
                                                                                          (hidden, hidden)))
    x, attn = normal(rng, (tokens, hidden)), normal(rng, (tokens, hidden))
    norm = jnp.ones(hidden) + 0.1 * normal(rng, (hidden,))
    ops = ModelOps("pallas", interpret=True, mosaic_prefill=True, policy=KernelPolicy(fp8_mosaic_gemv=mode))

    def layer(ops, x, attn):
        return ops.mlp_block(ops.out_proj(attn, wo, x), norm, wg, wu, wd, 1e-6)

    def rel(got, want):
        return float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want**2)))

    jaxpr = str(jax.make_jaxpr(lambda x, a: layer(ops, x, a))(x, attn))
    assert len(re.findall(r"name=fp8_gemv_mgpu(?!\w)", jaxpr)) == 4  # (the call sites: o, gate, up, down)
    # w8a8: the rows' e4m3 rounding; w8a16: their bf16 rounding (these rows are float32)
    lo, hi = (1e-3, 0.06) if mode == "w8a8" else (1e-4, 0.01)
    assert lo < rel(layer(ops, x, attn) - x, layer(ModelOps(), x, attn) - x) < hi
    wqkv = transpose(quantize(normal(rng, (hidden, 256), scale=hidden**-0.5), (128, 128)))
    assert ops.norm_qkv_rope_write(x, norm, wqkv, None, None, *[None] * 3, None, 1, 1, 1e-6) is None
    (got,), (want,) = (o.norm_projections(x, norm, (wqkv,), 1e-6) for o in (ops, ModelOps()))
    assert lo < rel(got, want) < hi
