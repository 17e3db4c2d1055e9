"""paged_decode_attention vs its jnp reference: page sizes, GQA ratios, head dims, ragged lengths, FP8 caches."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.paged_attention import (
    _plan_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
    plan_blocks,
)
from tests.kernels.conftest import MODES, assert_close, by_mode, fp8_kv, lower_for_cuda, paged_kv

# (page_size, num_heads, num_kv_heads, head_dim, dtype, seq_lens, num_splits, pages_per_block)
CASES = [
    pytest.param(8, 4, 4, 64, jnp.float32, [1, 8, 9, 40, 0], None, 2, id="p8-g1-d64-f32-auto"),
    pytest.param(16, 8, 2, 128, jnp.bfloat16, [1, 16, 17, 300], 1, 4, id="p16-g4-d128-bf16-nosplit"),
    pytest.param(16, 8, 2, 128, jnp.bfloat16, [1, 16, 17, 300], 3, 2, id="p16-g4-d128-bf16-split3"),
    pytest.param(64, 16, 2, 64, jnp.bfloat16, [1, 64, 65, 500, 0], None, 1, id="p64-g8-d64-bf16-auto"),
    pytest.param(16, 8, 1, 256, jnp.bfloat16, [1, 16, 17, 100], 2, 2, id="p16-g8-d256-bf16-split2"),
    pytest.param(16, 32, 2, 64, jnp.bfloat16, [1, 33, 200], 1, 2, id="p16-g16-d64-bf16-nosplit"),
    pytest.param(16, 8, 2, 128, jnp.float32, [0, 0], None, 4, id="all-padding"),
    pytest.param(16, 8, 2, 128, jnp.bfloat16, [1, 130, 300], None, None, id="p16-g4-d128-bf16-defaults"),
]


# The interpreter (one compile per case) leaves out p16-g4-d128-bf16-nosplit (one split: p16-g16-d64-bf16-nosplit and
# test_decode_batch_major_launch_order; GQA 4, head_dim 128, bf16: p16-g4-d128-bf16-split3) and
# p16-g4-d128-bf16-defaults (the default blocks and splits: test_default_launch_for_small_batches).
INTERPRET_CASES = [c for c in CASES if c.id not in ("p16-g4-d128-bf16-nosplit", "p16-g4-d128-bf16-defaults")]


@pytest.mark.parametrize("mode,page_size,heads,kv_heads,dim,dtype,lens,splits,ppb", by_mode(INTERPRET_CASES, CASES))
def test_decode_matches_reference(mode, page_size, heads, kv_heads, dim, dtype, lens, splits, ppb):
    rng = np.random.default_rng(page_size * 1000 + heads * 10 + dim)
    k, v, table = paged_kv(rng, lens, page_size, kv_heads, dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, dim)), dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_decode_attention(q, k, v, table, seq_lens, num_splits=splits, pages_per_block=ppb,
                                 interpret=mode == "interpret")
    ref = paged_decode_attention_reference(q, k, v, table, seq_lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype, mode)
    padding = np.asarray(lens) == 0
    if padding.any():
        assert not np.asarray(out[padding].astype(jnp.float32)).any()


FP8_CASES = [pytest.param(jnp.float32, 1, id="f32-nosplit"), pytest.param(jnp.bfloat16, 3, id="bf16-split3")]


@pytest.mark.parametrize("mode,dtype,splits", by_mode(FP8_CASES))
def test_decode_fp8_cache(mode, dtype, splits):
    """An FP8 cache with a scale per kv head at mixed lengths: the kernel as the reference reading the same cache
    (the dtype's tolerance), and both near the unquantized cache's result (e4m3's 3 mantissa bits: within 0.25 for
    unit-normal K and V)."""
    rng = np.random.default_rng(23)
    lens = [1, 16, 17, 70, 0]
    k, v, table = paged_kv(rng, lens, 8, 2, 64, dtype)
    k8, v8, ks, vs = fp8_kv(rng, k, v)
    q = jnp.asarray(rng.standard_normal((len(lens), 8, 64)), dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_decode_attention(q, k8, v8, table, seq_lens, ks, vs, num_splits=splits, pages_per_block=2,
                                 interpret=mode == "interpret")
    ref = paged_decode_attention_reference(q, k8, v8, table, seq_lens, ks, vs)
    assert out.dtype == q.dtype
    assert_close(out, ref, dtype, mode)
    exact = paged_decode_attention_reference(q, k, v, table, seq_lens)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(exact.astype(jnp.float32)), atol=0.25)
    assert not np.asarray(out[4].astype(jnp.float32)).any()


def test_decode_fp8_lowers_for_cuda():
    """The FP8 path through the Triton lowering (e4m3 -> bf16 conversions, the scales' loads), with and without
    split-K, on a machine without a GPU."""
    f8, s = jnp.float8_e4m3fn, jax.ShapeDtypeStruct
    cache, scales = s((8, 16, 2, 128), f8), s((2,), jnp.float32)
    for splits in (1, 2):
        decode = functools.partial(paged_decode_attention, num_splits=splits)
        text = lower_for_cuda(decode, s((2, 8, 128), jnp.bfloat16), cache, cache, s((2, 4), jnp.int32),
                              s((2,), jnp.int32), scales, scales)
        assert "paged_decode_attention_ppb" in text and "_fp8" in text


def test_decode_fp8_needs_its_scales():
    q, lens, table = jnp.zeros((2, 8, 64)), jnp.ones((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32)
    k8 = jnp.zeros((4, 16, 2, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        paged_decode_attention(q, k8, k8, table, lens, interpret=True)
    with pytest.raises(ValueError, match="v_scale"):
        paged_decode_attention(q, k8, k8, table, lens, jnp.ones((2,)), jnp.ones((3,)), interpret=True)
    with pytest.raises(ValueError, match="FP8 cache"):
        paged_decode_attention(q, jnp.zeros((4, 16, 2, 64)), jnp.zeros((4, 16, 2, 64)), table, lens,
                               jnp.ones((2,)), jnp.ones((2,)), interpret=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_decode_long_context_split_k(mode):
    """4k tokens with page 16: the automatic split-K path (many splits, most of the table used)."""
    rng = np.random.default_rng(7)
    lens = [4096, 1500]
    k, v, table = paged_kv(rng, lens, 16, 2, 128, jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.bfloat16)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_decode_attention(q, k, v, table, seq_lens, pages_per_block=8, interpret=mode == "interpret")
    assert_close(out, paged_decode_attention_reference(q, k, v, table, seq_lens), jnp.bfloat16, mode)


def test_launch_plan():
    """The measured defaults: 128-token blocks and 2 stages for a few sequences (64 under 8 kv-head programs),
    64 and 3 stages otherwise, shrunk to fit the shared-memory budget; no split-K once the batch fills the GPU."""
    assert plan_blocks(8, 16, 128, 2) == (8, 2)  # Qwen3-4B batch 1
    assert plan_blocks(4, 16, 128, 2) == (4, 2)  # Qwen3-30B-A3B batch 1
    assert plan_blocks(64, 16, 128, 2) == (4, 3)  # Qwen3-4B batch 8
    assert plan_blocks(4, 16, 256, 2) == (4, 2)  # head_dim 256: 64 tokens x 2 stages = 128 KB
    assert plan_blocks(64, 16, 256, 2) == (2, 3)  # ... 3 stages of 64 would be 192 KB
    assert plan_blocks(64, 64, 256, 2) == (1, 3)  # never below one page
    assert _plan_splits(32, 8, 16, None) == 1  # 256 programs: one split, no merge
    assert _plan_splits(8, 8, 16, None) == 5
    assert _plan_splits(1, 8, 9, None) == 9  # capped at the table's blocks
    assert _plan_splits(8, 8, 16, None, target_programs=128) == 2


def test_decode_argument_checks():
    q = jnp.zeros((2, 8, 64))
    k = jnp.zeros((4, 16, 2, 64))
    table = jnp.zeros((2, 2), jnp.int32)
    lens = jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="q heads"):
        paged_decode_attention(jnp.zeros((2, 7, 64)), k, k, table, lens, interpret=True)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k, k, table, jnp.ones((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="page_table"):
        paged_decode_attention(q, k, k, jnp.zeros((3, 2), jnp.int32), lens, interpret=True)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(jnp.zeros((2, 8, 32)), k, k, table, lens, interpret=True)
    with pytest.raises(ValueError, match="pages_per_block"):
        paged_decode_attention(q, k, k, table, lens, pages_per_block=3, interpret=True)


@pytest.mark.parametrize("mode", MODES)
def test_decode_batch_major_launch_order(mode):
    """kv_heads_fastest=False (batch-major launch order) computes the same thing."""
    rng = np.random.default_rng(11)
    lens = [5, 33, 16]
    k, v, table = paged_kv(rng, lens, 16, 2, 64, jnp.float32)
    q = jnp.asarray(rng.standard_normal((3, 8, 64)), jnp.float32)
    seq_lens = jnp.asarray(lens, jnp.int32)
    for splits in (1, 2):
        out = paged_decode_attention(q, k, v, table, seq_lens, num_splits=splits, pages_per_block=1,
                                     kv_heads_fastest=False, interpret=mode == "interpret")
        assert_close(out, paged_decode_attention_reference(q, k, v, table, seq_lens), jnp.float32, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kv_heads_fastest", [True, False])
def test_split_merge_kernel_matches_xla_merge(mode, kv_heads_fastest):
    """The split-K merge kernel against the XLA merge of the same partials (and the reference)."""
    rng = np.random.default_rng(11)
    lens = [1, 33, 130, 0]
    k, v, table = paged_kv(rng, lens, 16, 2, 64, jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(lens), 6, 64)), jnp.float32)  # group 3: rows padded to 16
    seq_lens = jnp.asarray(lens, jnp.int32)
    kw = dict(num_splits=3, pages_per_block=1, kv_heads_fastest=kv_heads_fastest, interpret=mode == "interpret")
    fused = paged_decode_attention(q, k, v, table, seq_lens, merge_kernel=True, **kw)
    xla = paged_decode_attention(q, k, v, table, seq_lens, merge_kernel=False, **kw)
    assert_close(fused, xla, jnp.float32, mode)
    assert_close(fused, paged_decode_attention_reference(q, k, v, table, seq_lens), jnp.float32, mode)
    assert not np.asarray(fused[3]).any()


@pytest.mark.parametrize("mode", MODES)
def test_split_k_sized_by_the_context_not_the_table(mode):
    """A wide page table (the engine's is max_model_len / page_size) holding short contexts: the splits divide
    each sequence's own blocks, so every split of a long-enough sequence has work, and the result is exact."""
    rng = np.random.default_rng(17)
    lens = [1, 40, 0, 300, 17]
    k, v, table = paged_kv(rng, lens, 16, 2, 64, jnp.bfloat16, pages_per_seq=64)
    q = jnp.asarray(rng.standard_normal((len(lens), 8, 64)), jnp.bfloat16)
    seq_lens = jnp.asarray(lens, jnp.int32)
    # (the interpreter: 8 splits, more than the 40-token sequence's 3 blocks, and the automatic count; 3 splits on a
    # table that fits the contexts: p16-g4-d128-bf16-split3)
    for splits in (8, None) if mode == "interpret" else (3, 8, None):
        out = paged_decode_attention(q, k, v, table, seq_lens, num_splits=splits, pages_per_block=1,
                                     interpret=mode == "interpret")
        assert_close(out, paged_decode_attention_reference(q, k, v, table, seq_lens), jnp.bfloat16, mode)
        assert not np.asarray(out[2].astype(jnp.float32)).any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch", [1, 3])
def test_default_launch_for_small_batches(mode, batch):
    """The defaults a decode step gets (no pages_per_block / stages given): 32-token blocks and 3 stages below 64
    programs, in a wide table, bf16."""
    rng = np.random.default_rng(19 + batch)
    lens = [1000, 17, 300][:batch]
    k, v, table = paged_kv(rng, lens, 16, 8, 128, jnp.bfloat16, pages_per_seq=128)
    q = jnp.asarray(rng.standard_normal((batch, 32, 128)), jnp.bfloat16)
    seq_lens = jnp.asarray(lens, jnp.int32)
    out = paged_decode_attention(q, k, v, table, seq_lens, interpret=mode == "interpret")
    want = paged_decode_attention_reference(q, k, v, table, seq_lens)
    assert_close(out, want, jnp.bfloat16, mode)



# ---- a few query tokens per sequence (query_len > 1: speculative decoding's verify steps) ----------------------------

# (page_size, num_heads, num_kv_heads, head_dim, dtype, seq_lens, new tokens per sequence, query_len, num_splits, ppb,
# fp8); tokens past the sequences' are bucket padding
MULTI_CASES = [
    pytest.param(8, 8, 2, 64, jnp.float32, [5, 40, 17, 0, 3], [3, 4, 1, 0, 2], 4, 1, 1, False, id="g4-q4-nosplit"),
    pytest.param(8, 8, 2, 64, jnp.float32, [5, 40, 17, 0, 3], [3, 4, 1, 0, 2], 4, 3, 1, False, id="g4-q4-split3"),
    pytest.param(16, 6, 2, 64, jnp.bfloat16, [2, 70, 33], [2, 5, 5], 5, 2, 2, False, id="g3-q5-bf16-split2"),
    pytest.param(16, 4, 4, 64, jnp.float32, [1, 16, 17, 0], [1, 2, 2, 0], 2, None, None, False, id="g1-q2-defaults"),
    pytest.param(8, 8, 2, 64, jnp.bfloat16, [6, 40, 0, 17], [4, 3, 0, 1], 4, 3, 1, True, id="g4-q4-fp8-split3"),
]


def multi_query_case(rng, lens, new, num_tokens, page_size, heads, kv_heads, dim, dtype, fp8=False):
    """Random paged K/V (shuffled pages) and ragged queries: (q [T, H, D], k, v, table, seq_lens, query_start, k_scale,
    v_scale)."""
    k, v, table = paged_kv(rng, lens, page_size, kv_heads, dim, dtype)
    scales = (None, None)
    if fp8:
        k, v, *scales = fp8_kv(rng, k, v)
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, dim)), dtype)
    return q, k, v, table, jnp.asarray(lens, jnp.int32), query_start, *scales


@pytest.mark.parametrize("mode,page_size,heads,kv_heads,dim,dtype,lens,new,query_len,splits,ppb,fp8",
                         by_mode(MULTI_CASES))
def test_multi_query_matches_ragged_reference(mode, page_size, heads, kv_heads, dim, dtype, lens, new, query_len,
                                              splits, ppb, fp8, request):
    """Each sequence's last n <= Q tokens, each masked causally at its own position, at mixed context lengths and page
    placements, against the ragged prefill reference (an independent jnp gather of every page); padding tokens and
    sequences give zeros."""
    from pallas_kernels.attention.prefill_attention import ragged_prefill_attention_reference

    if fp8 and mode == "gpu":  # (so verify steps over an FP8 cache keep the ragged kernel: ops/attention.py)
        request.applymarker(pytest.mark.xfail(reason="missed the reference beyond bf16 tolerance on an H200; cause "
                                                     "not found yet (the interpreter and the Q = 1 FP8 case pass)"))
    rng = np.random.default_rng(sum(lens) + query_len)
    total = sum(new)
    q, k, v, table, seq_lens, qs, ks, vs = multi_query_case(rng, lens, new, total + 5, page_size, heads, kv_heads, dim,
                                                            dtype, fp8)
    out = paged_decode_attention(q, k, v, table, seq_lens, ks, vs, query_start=qs, query_len=query_len,
                                 num_splits=splits, pages_per_block=ppb, interpret=mode == "interpret")
    ref = ragged_prefill_attention_reference(q, k, v, qs, seq_lens, table, ks, vs)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out[:total], ref[:total], dtype, mode)
    assert not np.asarray(out[total:].astype(jnp.float32)).any()


@pytest.mark.parametrize("mode", MODES)
def test_multi_query_launch_order_and_xla_merge(mode):
    """Batch-major launch order, and split-K merged by XLA (`merge_kernel=False`), compute the same; a query_len above
    every sequence's count changes nothing; the last token of each sequence is what the one-token kernel gives."""
    rng = np.random.default_rng(5)
    lens, new = [9, 33, 0, 20], [2, 3, 0, 1]
    q, k, v, table, seq_lens, qs, _, _ = multi_query_case(rng, lens, new, 8, 8, 8, 2, 64, jnp.float32)
    kw = dict(query_start=qs, num_splits=2, pages_per_block=1, interpret=mode == "interpret")
    want = paged_decode_attention(q, k, v, table, seq_lens, query_len=3, **kw)
    for extra in (dict(kv_heads_fastest=False), dict(merge_kernel=False), dict(query_len=8)):
        assert_close(paged_decode_attention(q, k, v, table, seq_lens, **{"query_len": 3, **kw, **extra}), want,
                     jnp.float32, mode)
    last = np.asarray(qs[1:]) - 1
    one = paged_decode_attention(q[last], k, v, table, seq_lens, num_splits=2, pages_per_block=1,
                                 interpret=mode == "interpret")
    real = np.asarray(new) > 0
    assert_close(want[last][real], one[real], jnp.float32, mode)


def test_multi_query_lowers_for_cuda():
    """query_len > 1 through the Triton lowering (row gathers and scatters, the padding rows' zeros, the ragged merge),
    bf16 and FP8 caches, with and without split-K."""
    s = jax.ShapeDtypeStruct
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        cache = s((64, 16, 8, 128), dtype)
        scales = (s((8,), jnp.float32),) * 2 if dtype == jnp.float8_e4m3fn else (None, None)
        for splits in (1, 4):
            def verify(q, k, v, table, lens, qs, ks=None, vs=None, splits=splits):
                return paged_decode_attention(q, k, v, table, lens, ks, vs, query_start=qs, query_len=5,
                                              num_splits=splits)

            args = (s((64, 32, 128), jnp.bfloat16), cache, cache, s((8, 64), jnp.int32), s((8,), jnp.int32),
                    s((9,), jnp.int32))
            text = lower_for_cuda(verify, *args, *[a for a in scales if a is not None])
            assert "_q5" in text and ("paged_decode_merge_s4_q5" in text) == (splits > 1)


def test_multi_query_argument_checks():
    q, k = jnp.zeros((8, 8, 64)), jnp.zeros((4, 16, 2, 64))
    table, lens, qs = jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="query_start"):
        paged_decode_attention(q, k, k, table, lens, query_len=4, interpret=True)
    with pytest.raises(ValueError, match="query_start"):
        paged_decode_attention(q[:2], k, k, table, lens, query_start=qs, interpret=True)
    with pytest.raises(ValueError, match="query_start must be"):
        paged_decode_attention(q, k, k, table, lens, query_start=qs[:2], query_len=4, interpret=True)
