"""skinny_gemm vs its jnp reference (XLA's own dot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.fp8 import quantize
from pallas_kernels.dense.skinny_gemm import default_config, skinny_gemm, skinny_gemm_reference
from tests.kernels.conftest import MODES, assert_close, lower_for_cuda

# (tokens, K, N, dtype, launch overrides, FP8 scale block or None)
CASES = [
    pytest.param(1, 256, 128, jnp.float32, {}, None, id="t1-f32"),
    pytest.param(5, 512, 192, jnp.bfloat16, {"block_n": 64, "k_splits": 2, "block_k": 64}, None, id="t5-bf16-split2"),
    pytest.param(17, 256, 256, jnp.bfloat16, {"block_n": 128, "k_splits": 4, "block_k": 32}, None,
                 id="t17-bf16-split4"),
    pytest.param(32, 128, 64, jnp.float32, {"block_n": 32}, None, id="t32-f32"),
    pytest.param(1, 16, 48, jnp.float32, {}, None, id="t1-k16-n48-defaults"),  # tiles shrink to the dims (16)
    # FP8 (x quantized to e4m3 per row and K tile, as the reference does): 128 x 128 blocks at the defaults (a scale
    # per tile); 32 x 48 blocks, column tiles across two of them
    pytest.param(1, 256, 256, jnp.bfloat16, {}, (128, 128), id="t1-bf16-fp8-b128"),
    pytest.param(3, 192, 96, jnp.float32, {"block_n": 16, "k_splits": 2, "block_k": 32}, (32, 48),
                 id="t3-f32-fp8-b32x48-split2"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tokens,k,n,dtype,kw,scale_block", CASES)
def test_skinny_gemm_matches_reference(mode, tokens, k, n, dtype, kw, scale_block):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) * k**-0.5, dtype)
    scale = None
    if scale_block is not None:
        q = quantize(w.astype(jnp.float32), scale_block)
        w, scale = q.w, q.scale
    # (an FP8 weight goes in [N, K], as checkpoints store it)
    out = skinny_gemm(x, w if scale is None else w.T, scale, scale_block=scale_block, interpret=mode == "interpret",
                      **kw)
    assert out.shape == (tokens, n) and out.dtype == jnp.float32
    ref = skinny_gemm_reference(x, w, scale, scale_block=scale_block, block_k=kw.get("block_k"))
    assert_close(out, ref, dtype, mode)


def test_default_config_fills_the_gpu_and_divides():
    for k, n in [(2560, 6144), (4096, 2560), (9728, 2560), (2560, 151936), (128, 64)]:
        c = default_config(k, n)
        assert n % c["block_n"] == 0 and k % (c["k_splits"] * c["block_k"]) == 0
    assert default_config(4096, 2560)["k_splits"] > 1  # 40 column blocks alone would leave SMs idle
    fp8 = default_config(4096, 4096, (128, 128))  # Qwen3-8B's o: a 128 x 128 scale block per tile
    assert (fp8["block_n"], fp8["block_k"]) == (128, 128) and default_config(4096, 4096, (64, 64))["block_k"] == 64
    # FP8 columns in ~1.5 waves of programs: an EAGLE-3 head's 32000-row lm_head unsplit, its q|k|v split 8 ways
    assert default_config(4096, 32000, (128, 128))["k_splits"] == 1 and default_config(8192, 6144, (128, 128))[
        "k_splits"] == 8


def test_skinny_gemm_argument_checks():
    x = jnp.zeros((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="tokens"):
        skinny_gemm(jnp.zeros((33, 64)), jnp.zeros((64, 64)), interpret=True)
    with pytest.raises(ValueError, match="block_n"):
        skinny_gemm(x, jnp.zeros((64, 96)), block_n=64, interpret=True)
    with pytest.raises(ValueError, match="k_splits"):
        skinny_gemm(x, jnp.zeros((64, 64)), k_splits=4, block_k=32, interpret=True)
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        skinny_gemm(x, jnp.zeros((32, 64)), interpret=True)
    q = quantize(jnp.ones((64, 64)), (32, 32))
    with pytest.raises(ValueError, match="must divide the FP8 scale blocks"):
        skinny_gemm(x, q.w, q.scale, scale_block=(32, 32), block_k=64, interpret=True)
    with pytest.raises(ValueError, match="needs its scales"):
        skinny_gemm(x, q.w, interpret=True)


def test_fp8_lowers_for_the_gpu():
    """Qwen3-8B's o projection in FP8 ([N, K], 128 x 128 blocks) through Pallas' Triton lowering."""
    s = jax.ShapeDtypeStruct
    text = lower_for_cuda(lambda x, w, sc: skinny_gemm(x, w, sc, scale_block=(128, 128)), s((8, 4096), jnp.bfloat16),
                          s((4096, 4096), jnp.float8_e4m3fn), s((32, 32), jnp.float32))
    assert "skinny_gemm_n128_k128_s4_fp8_nk" in text


def test_project_reads_fp8_weights_on_the_kernel_at_decode_sizes():
    """ModelOps.project (a draft head's projections and lm_head, Qwen3.5's q|k|v) with a block-FP8 weight kept [out, in]
    (fp8.kernel_layout): steps of <= fp8_max_tokens on the skinny GEMM, in the asked dtype, close to the product with
    the dequantized weight (the rows meet it as e4m3); larger steps and [in, out] weights dequantize as before."""
    from jinfer.models.fp8 import dequantize, transpose
    from jinfer.ops import ModelOps

    rng = np.random.default_rng(0)
    w = quantize(jnp.asarray(rng.standard_normal((64, 96)) * 64**-0.5, jnp.float32), (32, 32))
    ops = ModelOps("pallas", interpret=True)

    def kernel_calls(x, w, **kw):
        return str(jax.make_jaxpr(lambda x: ops.project(x, w, **kw))(x)).count("skinny_gemm_")

    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    assert kernel_calls(x, transpose(w), preferred_element_type=jnp.float32) == 1
    assert kernel_calls(x, w) == 0 and kernel_calls(jnp.zeros((17, 64)), transpose(w)) == 0
    got = ops.project(x.astype(jnp.bfloat16), transpose(w), preferred_element_type=jnp.float32)
    want = x @ dequantize(w)
    assert got.dtype == jnp.float32 and ops.project(x.astype(jnp.bfloat16), transpose(w)).dtype == jnp.bfloat16
    err = float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want**2)))
    assert 1e-4 < err < 0.06, err  # (e4m3 rows: not the exact product, but near it)
    # o at one token keeps its own switch: fp8_skinny_o off dequantizes a weight past XLA's strength reduction
    from jinfer.config.kernels import KernelPolicy

    wo = transpose(quantize(jnp.zeros((4096, 4096)), (128, 128)))  # (traced only)

    def o_calls(ops):
        fn = lambda a: ops.out_proj(a, wo, jnp.zeros((1, 4096)))  # noqa: E731
        return str(jax.make_jaxpr(fn)(jnp.zeros((1, 4096)))).count("skinny_gemm_")

    assert o_calls(ops) == 1 and o_calls(ModelOps("pallas", interpret=True,
                                                  policy=KernelPolicy(fp8_skinny_o=False))) == 0
