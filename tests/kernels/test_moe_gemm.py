"""moe_gate_up / moe_down (Pallas, Triton lowering) vs per-row jnp references, and the whole expert MLP
vs `layers.moe_mlp` (lax.ragged_dot: independent of the grouped layout)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.layers import moe_mlp
from pallas_kernels.moe.moe_gemm import (
    moe_combine,
    moe_down,
    moe_down_reference,
    moe_gate_up,
    moe_gate_up_reference,
)
from pallas_kernels.moe.moe_routing import moe_route_reference
from tests.kernels.conftest import assert_close, by_mode, lower_for_cuda

CASES = [  # tokens, experts, hidden, intermediate, top_k, block_m
    pytest.param(1, 16, 128, 64, 4, 16, id="decode-b1"),
    pytest.param(8, 16, 128, 64, 4, 16, id="decode-b8"),
    pytest.param(40, 4, 64, 32, 2, 16, id="several-blocks-per-expert"),
    pytest.param(96, 8, 128, 96, 2, 64, id="m64"),
]


def setup(tokens, experts, hidden, inter, top_k, block_m, dtype):
    ks = jax.random.split(jax.random.key(tokens + experts + hidden), 5)
    w = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * hidden**-0.5).astype(dtype)  # noqa: E731
    x = jax.random.normal(ks[0], (tokens, hidden), jnp.float32).astype(dtype)
    logits = jax.random.normal(ks[1], (tokens, experts), jnp.float32)
    r = moe_route_reference(logits, top_k=top_k, block_m=block_m)
    return x, logits, r, w(ks[2], (experts, hidden, inter)), w(ks[3], (experts, hidden, inter)), \
        w(ks[4], (experts, inter, hidden))


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
    ks = jax.random.split(jax.random.key(0), 9)
    w = lambda k, s: (jax.random.normal(k, s) * hidden**-0.5).astype(jnp.bfloat16)  # noqa: E731
    wg, wu, wd = w(ks[0], (e, hidden, inter)), w(ks[1], (e, hidden, inter)), w(ks[2], (e, inter, hidden))
    router = w(ks[3], (hidden, e)) * 8
    x = jax.random.normal(ks[4], (tokens, hidden)).astype(jnp.bfloat16)
    norm = jnp.ones(hidden, jnp.bfloat16)
    shared = (w(ks[5], (hidden, 64)), w(ks[6], (hidden, 64)), w(ks[7], (64, hidden)), w(ks[8], (hidden, 1)))
    # (top-1: the weights are the router's probabilities; the gated shared expert beside the routed ones)
    kw = dict(top_k=top_k, renormalize=False, eps=1e-6, shared=shared)
    out, _ = ModelOps("pallas", interpret=True, mosaic_prefill=True).moe_block(x, norm, router, wg, wu, wd, **kw)
    assert len(calls) == 2
    ref, _ = ModelOps().moe_block(x, norm, router, wg, wu, wd, **kw)
    assert_close(out, ref, jnp.bfloat16, "interpret")
