"""moe_gate_up / moe_down (Pallas, Triton lowering) vs per-row jnp references, and the whole expert MLP
vs `layers.moe_mlp` (lax.ragged_dot: independent of the grouped layout); with bf16 / f32 and block-FP8 experts (the
rows quantized to e4m3 per K tile: against references quantizing them alike, and against moe_mlp on
jinfer.models.fp8's dequantization, independent of the kernels' fp8_tiles, within the rows' FP8 rounding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models import fp8
from jinfer.models.fp8 import quantize
from jinfer.models.layers import moe_mlp
from pallas_kernels.moe.moe_gemm import (
    moe_combine,
    moe_down,
    moe_down_reference,
    moe_gate_up,
    moe_gate_up_reference,
)
from pallas_kernels.moe.moe_routing import moe_route_reference
from tests.kernels.conftest import assert_close, by_mode, lower_for_cuda, normal

# The rows' e4m3 rounding (~3% a value) against unquantized rows, as the relative RMS of the outputs: measured
# 0.034-0.045 on FP8_CASES, 0.019 on the model's block; bounded at ~2x.
FP8_REL_RMS = 0.1


def rel_rms(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(v, jnp.float32)) for v in (a, b))
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


CASES = [  # tokens, experts, hidden, intermediate, top_k, block_m
    pytest.param(1, 16, 128, 64, 4, 16, id="decode-b1"),
    pytest.param(8, 16, 128, 64, 4, 16, id="decode-b8"),
    pytest.param(40, 4, 64, 32, 2, 16, id="several-blocks-per-expert"),
    pytest.param(96, 8, 128, 96, 2, 64, id="m64"),
]


def setup(tokens, experts, hidden, inter, top_k, block_m, dtype):
    rng = np.random.default_rng(tokens + experts + hidden)
    w = lambda shape: normal(rng, shape, dtype, hidden**-0.5)  # noqa: E731
    x = normal(rng, (tokens, hidden), dtype)
    logits = normal(rng, (tokens, experts))
    r = moe_route_reference(logits, top_k=top_k, block_m=block_m)
    return x, logits, r, w((experts, hidden, inter)), w((experts, hidden, inter)), w((experts, inter, hidden))


DTYPES = [(jnp.float32, "f32"), (jnp.bfloat16, "bf16")]
GPU_CASES = [pytest.param(dt, *c.values, id=f"{did}-{c.id}") for dt, did in DTYPES for c in CASES]
# The interpreter (one compile per case and dtype) takes each layout once, the dtypes alternating: one token (bf16),
# 8 tokens over 16 experts (f32), several blocks of 16 rows per expert (f32), 64-row blocks (bf16).
INTERPRET_CASES = [pytest.param(dt, *c.values, id=f"{did}-{c.id}")
                   for (dt, did), c in zip([DTYPES[1], DTYPES[0], DTYPES[0], DTYPES[1]], CASES, strict=True)]


@pytest.mark.parametrize("mode,dtype,tokens,experts,hidden,inter,top_k,block_m", by_mode(INTERPRET_CASES, GPU_CASES))
def test_grouped_gemms_match_reference(mode, dtype, tokens, experts, hidden, inter, top_k, block_m):
    x, logits, r, wg, wu, wd = setup(tokens, experts, hidden, inter, top_k, block_m, dtype)
    interpret = mode == "interpret"
    h = moe_gate_up(x, r, wg, wu, interpret=interpret)
    rows = np.asarray(r.pair_rows).ravel()  # only valid rows are specified
    assert_close(np.asarray(h.astype(jnp.float32))[rows], moe_gate_up_reference(x, r, wg, wu)[rows], dtype, mode)
    y = moe_down(h, r, wd, interpret=interpret)
    assert y.shape == (tokens * top_k, hidden) and y.dtype == dtype
    assert_close(y, moe_down_reference(h, r, wd), dtype, mode)
    out = moe_combine(y, top_k, dtype)
    assert_close(out, moe_mlp(x, logits, wg, wu, wd, top_k, True), dtype, mode)


@pytest.mark.parametrize("tiles", [dict(block_n=16, block_k=16, num_warps=2, num_stages=2)])
def test_tile_overrides_agree(tiles):
    """Tiles smaller than the defaults (several column tiles and K steps in both kernels; num_warps / num_stages
    mean nothing to the interpreter, the Triton lowering test takes the defaults)."""
    x, logits, r, wg, wu, wd = setup(8, 16, 128, 64, 4, 16, jnp.float32)
    h = moe_gate_up(x, r, wg, wu, interpret=True, **tiles)
    y = moe_down(h, r, wd, interpret=True, **tiles)
    np.testing.assert_allclose(moe_combine(y, 4, x.dtype), moe_mlp(x, logits, wg, wu, wd, 4, True), atol=2e-5)


def test_argument_errors():
    x, logits, r, wg, wu, wd = setup(8, 16, 128, 64, 4, 16, jnp.float32)
    with pytest.raises(ValueError, match="w_gate"):
        moe_gate_up(x, r, wg[:, :64], wu, interpret=True)
    with pytest.raises(ValueError, match="routing is for 8 tokens"):
        moe_gate_up(x[:4], r, wg, wu, interpret=True)
    with pytest.raises(ValueError, match="block_m"):
        moe_gate_up(x, moe_route_reference(logits, top_k=4, block_m=8), wg, wu, interpret=True)
    with pytest.raises(ValueError, match="w_down"):
        moe_down(jnp.zeros((r.sorted_pairs.shape[0], 64)), r, wd[:, :32], interpret=True)
    with pytest.raises(ValueError, match="rows"):
        moe_down(jnp.zeros((16, 64)), r, wd, interpret=True)


def test_grouped_gemms_lower_for_cuda():
    """Qwen3-30B-A3B's expert shapes, decode-sized and prefill-sized layouts."""
    from pallas_kernels.moe.moe_routing import moe_route

    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16

    def mlp(x, logits, wg, wu, wd, block_m):
        r = moe_route(logits, top_k=8, block_m=block_m)
        return moe_combine(moe_down(moe_gate_up(x, r, wg, wu), r, wd), 8, x.dtype)

    for tokens, block_m in ((1, 16), (2048, 64)):
        text = lower_for_cuda(lambda *a, bm=block_m: mlp(*a, bm), S((tokens, 2048), bf), S((tokens, 128), bf),
                              S((128, 2048, 768), bf), S((128, 2048, 768), bf), S((128, 768, 2048), bf))
        assert f"moe_gate_up_m{block_m}" in text and f"moe_down_m{block_m}" in text


# Block-FP8 experts [E, out, in], as the engine keeps them (fp8.kernel_layout): (tokens, experts, hidden,
# intermediate, top_k, block_m, scale block, dtype). The tiny checkpoints' 16 x 16 blocks (column tiles spanning several
# blocks: a scale per column), and real checkpoints' 128 x 128 (a scale per tile; at 64-row blocks two K tiles per
# scale block).
FP8_CASES = [
    pytest.param(1, 4, 64, 48, 2, 16, (16, 16), jnp.float32, id="t1-f32-b16"),
    pytest.param(8, 4, 128, 128, 2, 16, (128, 128), jnp.bfloat16, id="t8-bf16-b128"),
    pytest.param(24, 2, 128, 128, 2, 64, (128, 128), jnp.float32, id="t24-f32-b128-m64"),
]
FP8_GPU_CASES = [  # Qwen3-30B-A3B's experts
    pytest.param(t, 128, 2048, 768, 8, bm, (128, 128), jnp.bfloat16, id=f"30b-a3b-t{t}")
    for t, bm in ((1, 16), (16, 16), (512, 64))]


def fp8_setup(tokens, experts, hidden, inter, top_k, block_m, block, dtype):
    """setup's inputs with the experts block-FP8 (jinfer.models.fp8.quantize of the float32 weights), [E, out, in]."""
    x, logits, r, *ws = setup(tokens, experts, hidden, inter, top_k, block_m, jnp.float32)
    return x.astype(dtype), logits, r, *(fp8.transpose(quantize(w, block)) for w in ws)


@pytest.mark.parametrize("mode,tokens,experts,hidden,inter,top_k,block_m,block,dtype",
                         by_mode(FP8_CASES, FP8_CASES + FP8_GPU_CASES))
def test_fp8_grouped_gemms_match_reference(mode, tokens, experts, hidden, inter, top_k, block_m, block, dtype):
    x, logits, r, wg, wu, wd = fp8_setup(tokens, experts, hidden, inter, top_k, block_m, block, dtype)
    interpret = mode == "interpret"
    kw = {"scale_block": block}
    h = moe_gate_up(x, r, wg.w, wu.w, (wg.scale, wu.scale), interpret=interpret, **kw)
    rows = np.asarray(r.pair_rows).ravel()
    ref_h = moe_gate_up_reference(x, r, wg.w, wu.w, (wg.scale, wu.scale), **kw)
    assert_close(np.asarray(h.astype(jnp.float32))[rows], ref_h[rows], dtype, mode)
    y = moe_down(h, r, wd.w, wd.scale, interpret=interpret, **kw)
    assert y.shape == (tokens * top_k, hidden) and y.dtype == dtype
    assert_close(y, moe_down_reference(h, r, wd.w, wd.scale, **kw), dtype, mode)
    # and within the rows' FP8 rounding of moe_mlp's unquantized rows, not equal to them
    rel = rel_rms(moe_combine(y, top_k, dtype), moe_mlp(x, logits, wg, wu, wd, top_k, True))
    assert 1e-3 < rel < FP8_REL_RMS, rel


def test_fp8_argument_errors():
    x, logits, r, wg, wu, wd = fp8_setup(8, 4, 64, 32, 2, 16, (16, 16), jnp.float32)
    with pytest.raises(ValueError, match="needs its scales"):  # (e4m3 values as a plain weight's [E, in, out])
        moe_gate_up(x, r, jnp.swapaxes(wg.w, 1, 2), jnp.swapaxes(wu.w, 1, 2), interpret=True)
    with pytest.raises(ValueError, match="scale must be float32"):
        moe_gate_up(x, r, wg.w, wu.w, (wg.scale, wu.scale[:, :1]), scale_block=(16, 16), interpret=True)
    with pytest.raises(ValueError, match="scales go with a float8_e4m3fn weight"):
        moe_down(jnp.zeros((r.sorted_pairs.shape[0], 32)), r, wd.w.astype(jnp.float32), wd.scale,
                 scale_block=(16, 16), interpret=True)
    with pytest.raises(ValueError, match="scale blocks' height"):
        moe_gate_up(x, r, wg.w, wu.w, (wg.scale, wu.scale), scale_block=(16, 16), block_k=32, interpret=True)


def test_fp8_grouped_gemms_lower_for_cuda():
    """Qwen3-30B-A3B's experts in block-FP8 (128 x 128) as the engine keeps them ([E, out, in]), decode-sized and
    prefill-sized layouts, through Pallas' Triton lowering (e4m3 loads, the rows quantized to e4m3, FP8 dots)."""
    from pallas_kernels.moe.moe_routing import moe_route

    S, bf, f8, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32

    def mlp(x, logits, wg, wu, wd, sg, su, sd, block_m):
        r = moe_route(logits, top_k=8, block_m=block_m)
        h = moe_gate_up(x, r, wg, wu, (sg, su), scale_block=(128, 128))
        return moe_combine(moe_down(h, r, wd, sd, scale_block=(128, 128)), 8, x.dtype)

    for tokens, block_m in ((1, 16), (2048, 64)):
        text = lower_for_cuda(lambda *a, bm=block_m: mlp(*a, bm), S((tokens, 2048), bf), S((tokens, 128), bf),
                              S((128, 768, 2048), f8), S((128, 768, 2048), f8), S((128, 2048, 768), f8),
                              S((128, 16, 6), f32), S((128, 16, 6), f32), S((128, 6, 16), f32))
        k = 128 if block_m == 16 else 64
        assert f"moe_gate_up_m{block_m}_n{64 if block_m == 16 else 128}_k{k}_fp8" in text
        assert f"moe_down_m{block_m}_n{64 if block_m == 16 else 128}_k{k}_fp8" in text


def test_model_moe_block_mosaic_path_matches_reference(monkeypatch):
    """ModelOps.moe_block with the Mosaic GPU grouped GEMM (steps with >= 128 rows per expert; Mosaic GPU
    interpreter here): the same output as the XLA reference block, with a gated shared expert (Qwen3.5-MoE's)."""
    import pallas_kernels.moe.moe_gemm_mgpu as mgpu
    from jinfer.ops import ModelOps

    calls = []
    real = mgpu.moe_grouped_matmul_mgpu
    monkeypatch.setattr(mgpu, "moe_grouped_matmul_mgpu", lambda *a, **kw: (calls.append(1), real(*a, **kw))[1])
    # 128 rows per expert on average (the threshold), in as few rows as it takes: the interpreter's time grows with them
    e, hidden, inter, top_k, tokens = 2, 128, 128, 1, 256
    rng = np.random.default_rng(0)
    w = lambda s, scale=1.0: normal(rng, s, jnp.bfloat16, scale * hidden**-0.5)  # noqa: E731
    wg, wu, wd = w((e, hidden, inter)), w((e, hidden, inter)), w((e, inter, hidden))
    router = w((hidden, e), 8.0)
    x = normal(rng, (tokens, hidden), jnp.bfloat16)
    norm = jnp.ones(hidden, jnp.bfloat16)
    shared = (w((hidden, 64)), w((hidden, 64)), w((64, hidden)), w((hidden, 1)))
    # (top-1: the weights are the router's probabilities; the gated shared expert beside the routed ones)
    kw = dict(top_k=top_k, renormalize=False, eps=1e-6, shared=shared)
    out, _ = ModelOps("pallas", interpret=True, mosaic_prefill=True).moe_block(x, norm, router, wg, wu, wd, **kw)
    assert len(calls) == 2
    ref, _ = ModelOps().moe_block(x, norm, router, wg, wu, wd, **kw)
    assert_close(out, ref, jnp.bfloat16, "interpret")


def test_model_moe_block_fp8_experts_on_the_kernels():
    """ModelOps.moe_block at a decode-sized step with block-FP8 routed experts (the grouped GEMMs read them) and a
    gated FP8 shared expert (the fused MLP kernel reads it; its [hidden, 1] gate is dequantized): the reference
    block's output (everything dequantized, lax.ragged_dot) within the rows' FP8 rounding, and no ragged_dot in the
    kernels' block."""
    from jinfer.ops import ModelOps

    e, hidden, inter, shared_inter, top_k, tokens, block = 4, 64, 32, 32, 2, 3, (16, 16)
    rng = np.random.default_rng(1)
    w = lambda s, scale=1.0: normal(rng, s, scale=scale * hidden**-0.5)  # noqa: E731
    # (the experts' and the fused MLP's FP8 values [out, in], as fp8.kernel_layout keeps them)
    wg, wu, wd = (fp8.transpose(quantize(w(s), block))
                  for s in ((e, hidden, inter), (e, hidden, inter), (e, inter, hidden)))
    shared = tuple(quantize(w(s), block) for s in ((hidden, shared_inter), (hidden, shared_inter),
                                                   (shared_inter, hidden), (hidden, 1)))
    shared = (*(fp8.transpose(q) for q in shared[:3]), shared[3])
    router = w((hidden, e), 8.0)
    x = normal(rng, (tokens, hidden))
    norm = jnp.ones(hidden)
    kw = dict(top_k=top_k, renormalize=True, eps=1e-6, shared=shared)
    ops = ModelOps("pallas", interpret=True)

    def block_out(ops, x):
        return ops.moe_block(x, norm, router, wg, wu, wd, **kw)[0]

    jaxpr = str(jax.make_jaxpr(lambda x: block_out(ops, x))(x))
    for kernel in ("moe_gate_up_m16_n32_k16_fp8", "moe_down_m16_n64_k16_fp8", "fused_swiglu_mlp_t16_i16_fp8_nk2"):
        assert kernel in jaxpr, kernel
    assert "ragged_dot" not in jaxpr
    got, want = block_out(ops, x) - x, block_out(ModelOps(), x) - x  # the MoE and shared experts' outputs
    rel = rel_rms(got, want)
    assert 1e-3 < rel < FP8_REL_RMS, rel
