"""norm_qkv_rope_write (input RMSNorm + q|k|v projection + q/k norm + RoPE + paged K/V write in one kernel)
vs its jnp reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.models.fp8 import quantize
from pallas_kernels.dense.norm_qkv_rope import check_supported, norm_qkv_rope_write, norm_qkv_rope_write_reference
from tests.kernels.conftest import (
    HAS_GPU,
    MODES,
    assert_close,
    assert_unwritten_rows_kept,
    by_mode,
    fp8_kv,
    lower_for_cuda,
)
from tests.kernels.test_qkv_rope import _inputs as qkv_rope_inputs
from tests.kernels.test_qkv_rope import assert_fp8_rows_close

# (tokens, hidden, heads, kv_heads, head_dim, page_size, qk_norm, dtype, FP8 scale block or None)
CASES = [
    pytest.param(1, 128, 4, 2, 64, 16, True, jnp.bfloat16, None, id="t1-qknorm-bf16"),
    pytest.param(5, 192, 2, 1, 32, 8, False, jnp.float32, None, id="t5-no-qknorm-f32"),
    pytest.param(17, 64, 2, 2, 32, 4, True, jnp.float32, None, id="t17-kvh-eq-h-f32"),
    pytest.param(3, 256, 4, 1, 128, 16, True, jnp.bfloat16, None, id="t3-d128-bf16"),
    # FP8 q|k|v (the normed rows quantized to e4m3 per K tile, as the reference does): a head's halves inside one scale
    # block (one scale per K tile and half), and across several (16-wide blocks: a scale per column), with 32-row K
    # tiles
    pytest.param(2, 256, 4, 2, 64, 16, True, jnp.bfloat16, (64, 64), id="t2-bf16-fp8-b64"),
    pytest.param(3, 128, 2, 1, 64, 8, False, jnp.float32, (32, 16), id="t3-f32-fp8-b32x16"),
]


def _inputs(rng, tokens, hidden, heads, kv_heads, dim, page_size, qk_norm, dtype, num_pages=8, scale_block=None):
    """x, its norm weight and a q|k|v weight, then qkv_rope's test inputs (positions' cos/sin, slots with padding,
    q/k norms, caches); with `scale_block` also the weight as block-FP8 values and their scales."""
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 2, dtype)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    w = jnp.asarray(rng.standard_normal((hidden, (heads + 2 * kv_heads) * dim)) * hidden**-0.5, dtype)
    _, *rest = qkv_rope_inputs(rng, tokens, heads, kv_heads, dim, page_size, qk_norm, dtype, num_pages=num_pages)
    if scale_block is None:
        return x, norm, w, *rest
    q = quantize(w.astype(jnp.float32), scale_block)
    return (x, norm, q.w, *rest), q.scale


GPU_CASES = [pytest.param(splits, *c.values, id=f"{c.id}-splits{splits}") for splits in (1, 2, 4) for c in CASES]
# The interpreter (one compile per case) takes each case once, at the most K splits its hidden size allows (64-wide
# K tiles, 32 for the 32-row scale blocks): split-K with 2 (t1, t3 FP8) and 4 (t3) splits, the plain launch (t5,
# t17); of the FP8 cases the one with a scale per column (one scale per half: tests/models/test_fp8.py's Pallas step).
INTERPRET_CASES = [pytest.param(splits, *c.values, id=f"{c.id}-splits{splits}")
                   for splits, c in zip([2, 1, 1, 4, 2], CASES[:4] + CASES[5:], strict=True)]


@pytest.mark.parametrize("mode,splits,tokens,hidden,heads,kv_heads,dim,page_size,qk_norm,dtype,scale_block",
                         by_mode(INTERPRET_CASES, GPU_CASES))
def test_matches_reference(mode, splits, tokens, hidden, heads, kv_heads, dim, page_size, qk_norm, dtype,
                           scale_block):
    block_k = 64 if scale_block is None else min(64, scale_block[0])
    if hidden % (block_k * splits):
        pytest.skip("K tiles do not split evenly")
    rng = np.random.default_rng(tokens * 100 + heads * 10 + dim)
    args = _inputs(rng, tokens, hidden, heads, kv_heads, dim, page_size, qk_norm, dtype, scale_block=scale_block)
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-6)
    kernel_args = args
    if scale_block is not None:
        args, scale = args
        kw.update(wqkv_scale=scale, scale_block=scale_block)
        kernel_args = (*args[:2], args[2].T, *args[3:])  # (the kernel reads an FP8 weight [out, in])
    before_k = np.asarray(args[8].astype(jnp.float32))
    # split-K: the counters come back all zero (a buffer shared by the calls of a step)
    counters = None if splits == 1 else jnp.zeros((heads + 2 * kv_heads + 3,), jnp.int32)
    q, kc, vc, cnt = norm_qkv_rope_write(*kernel_args, counters, **kw, block_k=block_k,
                                         k_splits=None if splits == 1 else splits, interpret=mode == "interpret")
    if splits > 1:
        np.testing.assert_array_equal(np.asarray(cnt), 0)
    rq, rk, rv, _ = norm_qkv_rope_write_reference(*args, **kw, **({} if scale_block is None else {"block_k": block_k}))
    assert q.shape == (tokens, heads, dim) and q.dtype == dtype
    assert_close(q, rq, dtype, mode)
    assert_close(kc, rk, dtype, mode)
    assert_close(vc, rv, dtype, mode)
    assert_unwritten_rows_kept(args[5], (kc, before_k))  # padding wrote nothing


@pytest.mark.parametrize("mode,splits", by_mode([pytest.param(2, id="splits2")]))
def test_fp8_cache_rows_quantized(mode, splits):
    """An FP8 cache: the K and V rows quantized with their kv head's scale as the reference does (split-K: the last
    split writes them)."""
    rng = np.random.default_rng(37)
    args = _inputs(rng, 3, 128, 4, 2, 64, 8, True, jnp.bfloat16)
    k8, v8, ks, vs = fp8_kv(rng, args[8], args[9])
    args = (*args[:8], k8, v8)
    kw = dict(num_heads=4, num_kv_heads=2, eps=1e-6, k_scale=ks, v_scale=vs)
    counters = jnp.zeros((4 + 2 * 2,), jnp.int32)
    q, kc, vc, _ = norm_qkv_rope_write(*args, counters, **kw, block_k=64, k_splits=splits,
                                       interpret=mode == "interpret")
    rq, rk, rv, _ = norm_qkv_rope_write_reference(*args, **kw)
    assert kc.dtype == vc.dtype == jnp.float8_e4m3fn
    assert_close(q, rq, jnp.bfloat16, mode)
    assert_fp8_rows_close(kc, rk, ks)
    assert_fp8_rows_close(vc, rv, vs)


def test_fp8_cache_lowers_for_the_gpu():
    """The FP8 cache's quantizing stores through Pallas' Triton lowering."""
    s, b, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cache, scales = s((8, 16, 2, 128), jnp.float8_e4m3fn), s((2,), jnp.float32)
    text = lower_for_cuda(
        lambda x, n, w, c, sn, sl, qn, kn, k, v, cnt, ks, vs: norm_qkv_rope_write(
            x, n, w, c, sn, sl, qn, kn, k, v, cnt, num_heads=8, num_kv_heads=2, k_scale=ks, v_scale=vs),
        s((4, 256), b), s((256,), b), s((256, 12 * 128), b), s((4, 128), b), s((4, 128), b), s((4,), i32),
        s((128,), b), s((128,), b), cache, cache, s((12,), i32), scales, scales)
    assert "_kvfp8" in text


def test_fp8_lowers_for_the_gpu():
    """Qwen3-8B's q|k|v in FP8 ([out, in], 128 x 128 blocks), split-K, through Pallas' Triton lowering. (With
    `prefetch` the lowering against an abstract device fails in a reduction's sharding, bf16 alike: unchecked.)"""
    s, b, f8, i32, h = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int32, 4096
    cache = s((64, 16, 8, 128), b)
    text = lower_for_cuda(
        lambda x, n, w, c, sn, sl, qn, kn, k, v, cnt, sc: norm_qkv_rope_write(
            x, n, w, c, sn, sl, qn, kn, k, v, cnt, num_heads=32, num_kv_heads=8, wqkv_scale=sc, scale_block=(128, 128)),
        s((1, h), b), s((h,), b), s((48 * 128, h), f8), s((1, 128), b), s((1, 128), b), s((1,), i32), s((128,), b),
        s((128,), b), cache, cache, s((1024,), i32), s((32, 48), jnp.float32))
    assert "norm_qkv_rope_write_k128_s8_fp8_nk" in text  # (8 K splits: default_k_splits)


def test_default_k_splits():
    from pallas_kernels.dense.norm_qkv_rope import default_k_splits

    assert default_k_splits(48, 2560, 128) == 2  # Qwen3-4B: 96 programs
    assert default_k_splits(40, 2048, 128) == 2  # Qwen3-30B-A3B
    assert default_k_splits(24, 2048, 128) == 4
    assert default_k_splits(80, 4096, 128) == 1
    assert default_k_splits(24, 384, 128) == 1  # 3 K tiles do not split
    # FP8: past one wave, while each split keeps 4 K tiles and the partials a quarter of the weight's bytes
    assert default_k_splits(48, 4096, 128, fp8=True) == 8  # Qwen3-8B: 384 programs
    assert default_k_splits(48, 4096, 128, fp8=True, tokens=8) == 8
    assert default_k_splits(48, 4096, 128, fp8=True, tokens=32) == 4
    assert default_k_splits(48, 4096, 128, fp8=True, tokens=64) == 2
    assert default_k_splits(48, 2560, 128, fp8=True) == 4  # Qwen3-4B: 20 tiles
    assert default_k_splits(24, 384, 128, fp8=True) == 1


def test_check_supported():
    assert check_supported(1, 2560, 6144, 32, 8, 128, 128) is None
    assert "tokens" in check_supported(65, 2560, 6144, 32, 8, 128, 128)
    assert "partial RoPE" in check_supported(1, 2560, 6144, 32, 8, 128, 64)
    assert "width" in check_supported(1, 2560, 6000, 32, 8, 128, 128)
    with pytest.raises(ValueError, match="partial RoPE"):
        rng = np.random.default_rng(0)
        args = list(_inputs(rng, 1, 128, 4, 2, 64, 16, True, jnp.float32))
        args[3], args[4] = args[3][:, :32], args[4][:, :32]
        norm_qkv_rope_write(*args, num_heads=4, num_kv_heads=2, interpret=True)


def _chain(args, layers, counters, splits, interpret, reference=False):
    """`layers` calls in one jit, each layer's x from the last one's q, the K/V caches and counters passed on."""
    x0, norm, w, cos, sin, slots, qn, kn, k0, v0 = args
    tokens, hidden = x0.shape
    heads = w.shape[1] // k0.shape[-1] - 2 * k0.shape[2]
    kw = dict(num_heads=heads, num_kv_heads=k0.shape[2], eps=1e-6)

    @jax.jit
    def run(x, kc, vc, cnt):
        qs = []
        for _ in range(layers):
            if reference:
                q, kc, vc, cnt = norm_qkv_rope_write_reference(x, norm, w, cos, sin, slots, qn, kn, kc, vc, cnt, **kw)
            else:
                q, kc, vc, cnt = norm_qkv_rope_write(x, norm, w, cos, sin, slots, qn, kn, kc, vc, cnt, **kw,
                                                     k_splits=splits, block_k=64, interpret=interpret)
            qs.append(q)
            x = (x.astype(jnp.float32) + 0.1 * q.reshape(tokens, -1)[:, :hidden].astype(jnp.float32)).astype(x.dtype)
        return jnp.stack(qs), kc, vc, cnt

    return run(x0, k0, v0, counters)


LAYER_CASES = [pytest.param(1, 2, id="1-2"), pytest.param(33, 4, id="33-4"), pytest.param(64, 2, id="64-2")]


# The interpreter: two layers (the second finds the counters the first left) at 33 tokens (several token blocks) and
# 4 splits; split-K at 1 and 3 tokens (2 and 4 splits): test_matches_reference's t1 and t3 cases.
@pytest.mark.parametrize("mode,tokens,splits", by_mode(LAYER_CASES[1:2], LAYER_CASES))
def test_split_k_layers_share_one_counter_buffer(mode, tokens, splits):
    """Layers chained through one counters buffer (as `ModelOps.step_counters` is used): every layer's q and the
    caches match the reference, and the counters come back zero."""
    rng = np.random.default_rng(tokens)
    args = _inputs(rng, tokens, 256, 4, 2, 64, 16, True, jnp.float32, num_pages=tokens // 16 + 3)
    layers = 2 if mode == "interpret" else 3
    q, kc, vc, cnt = _chain(args, layers, jnp.zeros((64,), jnp.int32), splits, mode == "interpret")
    rq, rk, rv, _ = _chain(args, layers, None, None, mode == "interpret", reference=True)
    np.testing.assert_array_equal(np.asarray(cnt), 0)
    for got, want in ((q, rq), (kc, rk), (vc, rv)):
        assert_close(got, want, jnp.float32, mode)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU, reason="no GPU")
@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_is_deterministic_on_gpu(splits):
    """Qwen3-4B's shapes, 36 chained layers, 50 repeats: bit-identical every time (the last-arrival sum adds the
    partials in split order whichever program arrives last), counters back to zero, within bf16 of 1 split."""
    rng = np.random.default_rng(1)
    args = _inputs(rng, 1, 2560, 32, 8, 128, 16, True, jnp.bfloat16, num_pages=8)
    zeros = jnp.zeros((1024,), jnp.int32)
    first = _chain(args, 36, zeros, splits, False)
    for _ in range(50):
        again = _chain(args, 36, zeros, splits, False)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(first[3]), 0)
    one = _chain(args, 36, None, None, False)
    assert_close(first[0], one[0], jnp.bfloat16, "gpu")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("programs", [2, 6])
def test_prefetch_programs_change_nothing(mode, programs):
    """Extra programs reading another array into L2 (a layer's o weight): the outputs are those of the plain launch,
    bit for bit, whatever the prefetched array's size against the programs' shares."""
    rng = np.random.default_rng(5)
    args = _inputs(rng, 3, 256, 4, 1, 128, 16, True, jnp.bfloat16)
    kw = dict(num_heads=4, num_kv_heads=1, eps=1e-6, block_k=64, k_splits=2, interpret=mode == "interpret")
    counters = jnp.zeros((8,), jnp.int32)
    plain = norm_qkv_rope_write(*args, counters, **kw)
    wo = jnp.asarray(rng.standard_normal((4 * 128, 320)), jnp.bfloat16)  # 640 rows of 256: not a whole number of tiles
    fetched = norm_qkv_rope_write(*args, counters, **kw, prefetch=wo, prefetch_programs=programs,
                                  prefetch_fraction=0.6 if programs == 6 else 1.0)
    for a, b in zip(plain[:3], fetched[:3], strict=True):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(fetched[3]), 0)
    with pytest.raises(ValueError, match="prefetch"):
        norm_qkv_rope_write(*args, counters, **kw, prefetch=jnp.zeros((3, 5), jnp.bfloat16))
    with pytest.raises(ValueError, match="prefetch_programs"):
        norm_qkv_rope_write(*args, counters, **kw, prefetch=wo, prefetch_programs=3)
