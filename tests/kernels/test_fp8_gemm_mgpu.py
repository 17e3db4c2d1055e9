"""fp8_gemm_mgpu (Mosaic GPU: persistent grid, TMA ring, e4m3 wgmma; block-FP8 weights [N, K]) vs its jnp reference
and vs the unquantized product. "interpret" runs jax's Mosaic GPU interpreter on CPU; "gpu" compiles for Hopper. A CPU
test lowers the kernel for CUDA at Qwen3-8B's shapes (Mosaic GPU's layout inference, TMA legality, SMEM)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.fp8 import quantize
from pallas_kernels.dense.fp8_gemm_mgpu import SMEM_BYTES, default_config, fp8_gemm_mgpu, fp8_gemm_reference, smem_bytes
from pallas_kernels.dense.fp8_tiles import dequantize
from tests.kernels.conftest import by_mode, normal

CASES = [  # tokens, K, N, launch
    pytest.param(200, 256, 256, {"max_steps": 2, "grid_width": 2}, id="t200-m"),  # rows padded; 2 x 2 CTA tiles
    pytest.param(70, 384, 512, {"wg_dim": "n", "max_steps": 2, "grid_minor": 1}, id="t70-n"),
    pytest.param(40, 512, 256, {"k_splits": 2, "max_steps": 2}, id="t40-split2"),
]
GPU_CASES = CASES + [pytest.param(4096, 4096, 12288, {}, id="t4096-gate"),
                     pytest.param(1000, 12288, 4096, {"wg_dim": "n"}, id="t1000-down-n"),
                     pytest.param(32, 12288, 4096, {}, id="t32-down")]  # (4 K splits)


@pytest.mark.parametrize("mode,tokens,k,n,launch", by_mode(CASES, GPU_CASES))
def test_fp8_gemm_mgpu_matches_reference(mode, tokens, k, n, launch):
    rng = np.random.default_rng(tokens + k + n)
    # blocks of magnitudes 2^-4 .. 2^4 apart: each K step's product must meet its own block's scale
    spread = jnp.repeat(jnp.repeat(jnp.asarray(2.0 ** rng.integers(-4, 5, (k // 128, n // 128)), jnp.float32), 128, 0),
                        128, 1)
    q = quantize(normal(rng, (k, n), scale=k**-0.5) * spread, (128, 128))
    w = jnp.asarray(q.w.T)  # [N, K], as checkpoints store it
    # rows of magnitudes 2^-3 .. 2^3 apart (each row's own scale), the last one zero (a padded token stays zero)
    x = (normal(rng, (tokens, k)) * jnp.asarray(2.0 ** rng.integers(-3, 4, (tokens, 1)), jnp.float32)).at[-1].set(0)
    x = x.astype(jnp.bfloat16)
    out = fp8_gemm_mgpu(x, w, q.scale, interpret=mode == "interpret", **launch)
    assert out.shape == (tokens, n) and out.dtype == jnp.bfloat16
    ref = fp8_gemm_reference(x, w, q.scale, out_dtype=jnp.float32)
    # bf16 output; on the GPU, FP8 wgmma keeps fewer accumulator bits within a 128-deep K step than fp32
    got = np.asarray(out.astype(jnp.float32))
    np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-2, atol=2e-3 * float(jnp.max(jnp.abs(ref))))
    assert not np.any(got[-1])
    # against the unquantized rows: the e4m3 rounding of the activations (3 mantissa bits), as a relative RMS
    full = x.astype(jnp.float32) @ dequantize(q.w, q.scale, (128, 128))
    rel = float(jnp.sqrt(jnp.mean((got - full) ** 2) / jnp.mean(full**2)))
    assert 1e-3 < rel < 0.06, rel


def test_fp8_gemm_mgpu_lowers_for_cuda():
    """Exporting for CUDA runs Mosaic GPU's own compile steps (the interpreter does not) at Qwen3-8B's q|k|v and
    down shapes, both CTA tilings, the deepest rings the SMEM budget takes (`smem_bytes`)."""
    from jax import export

    assert smem_bytes("m", 6, jnp.bfloat16) > SMEM_BYTES >= smem_bytes("m", 5, jnp.bfloat16)
    assert smem_bytes("n", 5, jnp.bfloat16) > SMEM_BYTES >= smem_bytes("n", 4, jnp.bfloat16)
    s = jax.ShapeDtypeStruct
    for n, k, tokens, launch in ((6144, 4096, 1000, {"max_steps": 5}), (4096, 12288, 4096, {"wg_dim": "n",
                                                                                           "max_steps": 4}),
                                 (4096, 12288, 32, {})):  # (a decode-sized step: 4 K splits, float32 partials)
        fn = jax.jit(lambda x, w, sc, launch=launch: fp8_gemm_mgpu(x, w, sc, **launch))
        exp = export.export(fn, platforms=["cuda"])(s((tokens, k), jnp.bfloat16), s((n, k), jnp.float8_e4m3fn),
                                                    s((k // 128, n // 128), jnp.float32))
        assert "mosaic_gpu" in exp.mlir_module()
        assert exp.out_avals[0].shape == (tokens, n)
    # grouped, at Qwen3-30B-A3B's gate / up (128 experts [768, 2048]; 4096 tokens x top-8 in 128-row blocks)
    blocks = 4096 * 8 // 128 + 128
    exp = export.export(jax.jit(fp8_gemm_mgpu), platforms=["cuda"])(
        s((128 * blocks, 2048), jnp.bfloat16), s((128, 768, 2048), jnp.float8_e4m3fn), s((128, 16, 6), jnp.float32),
        s((blocks,), jnp.int32))
    assert "fp8_gemm_mgpu_m_r4_s1_grouped" in exp.mlir_module()


def test_fp8_gemm_mgpu_checks():
    # K splits where the output's tiles leave SMs idle (decode-sized steps), each split >= 4 K steps
    assert default_config(32, 4096, 12288)["k_splits"] == 4  # 32 tiles x 4 of 132 SMs
    assert default_config(32, 6144, 4096)["k_splits"] == 2
    assert default_config(32, 4096, 512)["k_splits"] == 1  # (4 K steps)
    assert default_config(4096, 12288, 4096)["k_splits"] == 1
    w = jnp.zeros((256, 512), jnp.float8_e4m3fn)
    scale = jnp.ones((4, 2), jnp.float32)
    x = jnp.zeros((128, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="N % 256"):
        fp8_gemm_mgpu(x, jnp.zeros((128, 512), jnp.float8_e4m3fn), jnp.ones((4, 1), jnp.float32), wg_dim="n",
                      interpret=True)
    with pytest.raises(ValueError, match="k_splits"):
        fp8_gemm_mgpu(x, w, scale, k_splits=8, interpret=True)
    with pytest.raises(ValueError, match="wg_dim"):
        fp8_gemm_mgpu(x, w, scale, wg_dim="M", interpret=True)
    with pytest.raises(ValueError, match="SMEM"):
        fp8_gemm_mgpu(x, w, scale, max_steps=6, interpret=True)
    with pytest.raises(ValueError, match="scale"):
        fp8_gemm_mgpu(x, w, jnp.ones((4, 3), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="128 x 128"):
        fp8_gemm_mgpu(x, w, scale, scale_block=(64, 64), interpret=True)


def test_ops_take_it_for_fp8_prefill_steps():
    """A step of more than fp8_max_tokens tokens with block-FP8 [out, in] weights runs q|k|v, o and the MLP (gate, up,
    down) on this kernel where Mosaic kernels are on (the jnp path's results, weights dequantized and activations
    unquantized, within the rows' e4m3 rounding); without Mosaic kernels ("pallas-triton"), or at decode sizes, not."""
    from jinfer.models.fp8 import transpose
    from jinfer.ops import ModelOps

    hidden, inter, tokens = 128, 256, 40
    rng = np.random.default_rng(0)
    wg, wu = (transpose(quantize(normal(rng, (hidden, inter), scale=hidden**-0.5), (128, 128))) for _ in range(2))
    wd, wo, wqkv = (transpose(quantize(normal(rng, s, scale=s[0]**-0.5), (128, 128)))
                    for s in ((inter, hidden), (hidden, hidden), (hidden, 256)))
    x, attn = normal(rng, (tokens, hidden)), normal(rng, (tokens, hidden))
    norm = jnp.ones(hidden) + 0.1 * normal(rng, (hidden,))
    ops = ModelOps("pallas", interpret=True, mosaic_prefill=True)

    def layer(ops, x, attn):
        (qkv,) = ops.norm_projections(x, norm, (wqkv,), 1e-6)
        return ops.mlp_block(ops.out_proj(attn, wo, x), norm, wg, wu, wd, 1e-6), qkv

    def calls(ops, x):
        return len(re.findall(r"name=fp8_gemm_mgpu(?!\w)", str(jax.make_jaxpr(lambda x, a: layer(ops, x, a))(x, x))))

    def rel(got, want):
        return float(jnp.sqrt(jnp.mean((got - want) ** 2) / jnp.mean(want**2)))

    assert calls(ops, x) == 5  # (the call sites: q|k|v, o, gate, up, down)
    # (the interpreted kernels finish before the reference runs: one full run under xdist hung in the reference's eager
    # ops with them dispatched just before)
    out, qkv = jax.block_until_ready(layer(ops, x, attn))
    want_out, want_qkv = layer(ModelOps(), x, attn)
    assert 1e-3 < rel(out - x, want_out - x) < 0.06
    assert 1e-3 < rel(qkv, want_qkv) < 0.06
    assert calls(ModelOps("pallas", interpret=True), x) == 0
    assert calls(ops, x[:16]) == 0  # decode-sized: the Triton kernels


GROUPED_CASES = [pytest.param(3, 256, 256, [0, 2, -1, 1], id="e3-unused-block")]  # experts, K, N, block_expert
GROUPED_GPU_CASES = GROUPED_CASES + [  # Qwen3-30B-A3B's gate / up and down, 16 blocks over 8 experts
    pytest.param(8, 2048, 768, [e // 2 for e in range(16)], id="30b-gate"),
    pytest.param(8, 768, 2048, [e // 2 for e in range(15)] + [-1], id="30b-down")]


@pytest.mark.parametrize("mode,experts,k,n,block_expert", by_mode(GROUPED_CASES, GROUPED_GPU_CASES))
def test_grouped_fp8_gemm_matches_reference(mode, experts, k, n, block_expert):
    """block_expert: each block of 128 rows times its expert's [N, K] weight and scales; an unused block (-1) is
    skipped (its rows are not computed: not compared)."""
    rng = np.random.default_rng(k + n)
    qs = [quantize(normal(rng, (k, n), scale=k**-0.5 * 2.0**e), (128, 128)) for e in range(experts)]
    w, scale = jnp.stack([q.w.T for q in qs]), jnp.stack([q.scale for q in qs])  # [E, N, K], [E, K/128, N/128]
    be = jnp.asarray(block_expert, jnp.int32)
    x = normal(rng, (128 * len(block_expert), k), jnp.bfloat16)
    out = fp8_gemm_mgpu(x, w, scale, be, interpret=mode == "interpret", out_dtype=jnp.float32)
    ref = fp8_gemm_reference(x, w, scale, be, jnp.float32)
    used = np.repeat(np.asarray(block_expert) >= 0, 128)
    got, want = np.asarray(out)[used], np.asarray(ref)[used]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-3 * float(np.abs(want).max()))
    with pytest.raises(ValueError, match="blocks of 128"):
        fp8_gemm_mgpu(x[:100], w, scale, be[:1], interpret=True)


def test_moe_block_fp8_experts_take_the_grouped_gemm(monkeypatch):
    """ModelOps.moe_block at a step with >= mosaic_moe_min_rows_per_expert rows per expert and block-FP8 experts
    [E, out, in] (as the engine keeps them) in 128 x 128 blocks: the grouped e4m3 GEMM (three calls: gate, up, down),
    the reference block's output (experts dequantized, lax.ragged_dot) within the rows' e4m3 rounding."""
    import pallas_kernels.moe.moe_fp8_mgpu as mod
    from jinfer.models.fp8 import transpose
    from jinfer.ops import ModelOps

    calls = []
    real = mod.fp8_gemm_mgpu
    monkeypatch.setattr(mod, "fp8_gemm_mgpu", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    e, hidden, inter, top_k, tokens = 2, 128, 128, 1, 256  # (128 rows per expert on average: the threshold)
    rng = np.random.default_rng(0)
    w = lambda s, scale=1.0: normal(rng, s, scale=scale * hidden**-0.5)  # noqa: E731
    wg, wu, wd = (transpose(quantize(w(s), (128, 128))) for s in ((e, hidden, inter), (e, hidden, inter),
                                                                   (e, inter, hidden)))
    router, x, norm = w((hidden, e), 8.0), normal(rng, (tokens, hidden)), jnp.ones(hidden)
    kw = dict(top_k=top_k, renormalize=False, eps=1e-6)
    out, _ = ModelOps("pallas", interpret=True, mosaic_prefill=True).moe_block(x, norm, router, wg, wu, wd, **kw)
    assert len(calls) == 3
    ref, _ = ModelOps().moe_block(x, norm, router, wg, wu, wd, **kw)
    rel = float(jnp.sqrt(jnp.mean((out - ref) ** 2) / jnp.mean((ref - x) ** 2)))
    assert 1e-3 < rel < 0.06, rel
