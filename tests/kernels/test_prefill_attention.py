"""ragged_prefill_attention vs its jnp reference on mixed (chunked prefill + decode) batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.prefill_attention import ragged_prefill_attention, ragged_prefill_attention_reference
from tests.kernels.conftest import MODES, assert_close, by_mode, fp8_kv, lower_for_cuda, paged_kv

# seqs: (new tokens, context length incl. them); (0, 0) is a padding sequence
CASES = [
    pytest.param(8, 4, 4, 64, jnp.float32, [(1, 1), (8, 8), (9, 9), (5, 20), (1, 30), (0, 0)], 3, None,
                 id="p8-g1-d64-f32"),
    pytest.param(8, 4, 4, 64, jnp.float32, [(9, 9), (13, 40), (1, 2)], 0, 4, id="p8-g1-d64-f32-bq4"),
    pytest.param(16, 8, 2, 128, jnp.bfloat16, [(17, 17), (3, 40), (1, 16), (16, 33)], 2, None,
                 id="p16-g4-d128-bf16"),
    pytest.param(64, 16, 2, 64, jnp.bfloat16, [(65, 65), (1, 100), (10, 74), (0, 0)], 0, None,
                 id="p64-g8-d64-bf16"),
    pytest.param(16, 8, 2, 256, jnp.bfloat16, [(20, 20), (1, 17)], 1, None, id="p16-g4-d256-bf16"),
    pytest.param(16, 4, 4, 128, jnp.float32, [(1, 1)], 0, None, id="single-token"),
]


def _batch(rng, seqs, pad_tokens, page_size, heads, kv_heads, dim, dtype):
    k, v, table = paged_kv(rng, [c for _, c in seqs], page_size, kv_heads, dim, dtype)
    qlens = [n for n, _ in seqs]
    query_start = jnp.asarray(np.concatenate([[0], np.cumsum(qlens)]), jnp.int32)
    num_tokens = sum(qlens) + pad_tokens
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, dim)), dtype)
    return q, k, v, query_start, jnp.asarray([c for _, c in seqs], jnp.int32), table


# The interpreter (one compile per case) leaves out p16-g4-d128-bf16: pages of 16, GQA 4, head_dim 128 in bf16 with
# chunks after cached tokens, decodes and padding tokens are test_prefill_long_chunk's.
@pytest.mark.parametrize("mode,page_size,heads,kv_heads,dim,dtype,seqs,pad,block_q",
                         by_mode([c for c in CASES if c.id != "p16-g4-d128-bf16"], CASES))
def test_prefill_matches_reference(mode, page_size, heads, kv_heads, dim, dtype, seqs, pad, block_q):
    rng = np.random.default_rng(len(seqs) * 100 + dim + page_size)
    q, k, v, qs, lens, table = _batch(rng, seqs, pad, page_size, heads, kv_heads, dim, dtype)
    out = ragged_prefill_attention(q, k, v, qs, lens, table, block_q=block_q, interpret=mode == "interpret")
    ref = ragged_prefill_attention_reference(q, k, v, qs, lens, table)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype, mode)
    real = int(qs[-1])
    assert not np.asarray(out[real:].astype(jnp.float32)).any(), "padding tokens must be zeros"


@pytest.mark.parametrize("mode,dtype", by_mode([pytest.param(jnp.float32, id="f32"),
                                                 pytest.param(jnp.bfloat16, id="bf16")]))
def test_prefill_fp8_cache(mode, dtype):
    """An FP8 cache with a scale per kv head: prefills, a chunk after cached tokens, a decode and padding against the
    reference reading the same cache, and near the unquantized cache's result (e4m3: within 0.25)."""
    rng = np.random.default_rng(29)
    q, k, v, qs, lens, table = _batch(rng, [(9, 9), (5, 30), (1, 17), (0, 0)], 2, 8, 8, 2, 64, dtype)
    k8, v8, ks, vs = fp8_kv(rng, k, v)
    out = ragged_prefill_attention(q, k8, v8, qs, lens, table, k_scale=ks, v_scale=vs, interpret=mode == "interpret")
    ref = ragged_prefill_attention_reference(q, k8, v8, qs, lens, table, ks, vs)
    assert_close(out, ref, dtype, mode)
    exact = ragged_prefill_attention_reference(q, k, v, qs, lens, table)
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), np.asarray(exact.astype(jnp.float32)), atol=0.25)
    assert not np.asarray(out[int(qs[-1]):].astype(jnp.float32)).any()


def test_prefill_fp8_lowers_for_cuda():
    """The FP8 path through the Triton lowering on a machine without a GPU."""
    s = jax.ShapeDtypeStruct
    cache, scales = s((8, 16, 2, 128), jnp.float8_e4m3fn), s((2,), jnp.float32)
    text = lower_for_cuda(ragged_prefill_attention, s((32, 8, 128), jnp.bfloat16), cache, cache, s((3,), jnp.int32),
                          s((2,), jnp.int32), s((2, 4), jnp.int32), None, None, scales, scales)
    assert "ragged_prefill_attention_bq" in text and "_fp8" in text


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_prefill_long_chunk(mode):
    """A 300-token chunk after 700 cached tokens next to a fresh 200-token prompt and two decodes."""
    rng = np.random.default_rng(3)
    seqs = [(300, 1000), (200, 200), (1, 513), (1, 64)]
    q, k, v, qs, lens, table = _batch(rng, seqs, 11, 16, 8, 2, 128, jnp.bfloat16)
    out = ragged_prefill_attention(q, k, v, qs, lens, table, interpret=mode == "interpret")
    ref = ragged_prefill_attention_reference(q, k, v, qs, lens, table)
    assert_close(out, ref, jnp.bfloat16, mode)


def test_prefill_argument_checks():
    q = jnp.zeros((5, 8, 64))
    k = jnp.zeros((4, 16, 2, 64))
    table = jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(ValueError, match="query_start"):
        ragged_prefill_attention(q, k, k, jnp.zeros((2,), jnp.int32), jnp.ones((2,), jnp.int32), table,
                                 interpret=True)
    with pytest.raises(ValueError, match="seq_lens"):
        ragged_prefill_attention(q, k, k, jnp.zeros((3,), jnp.int32), jnp.ones((1,), jnp.int32), table,
                                 interpret=True)
    with pytest.raises(ValueError, match="k_cache"):
        ragged_prefill_attention(q, k, jnp.zeros((4, 16, 2, 32)), jnp.zeros((3,), jnp.int32),
                                 jnp.ones((2,), jnp.int32), table, interpret=True)
    qs, lens = jnp.zeros((3,), jnp.int32), jnp.ones((2,), jnp.int32)
    with pytest.raises(ValueError, match="seq_mask"):
        ragged_prefill_attention(q, k, k, qs, lens, table, jnp.ones((3,), bool), interpret=True)
    with pytest.raises(ValueError, match="out must come with a seq_mask"):
        ragged_prefill_attention(q, k, k, qs, lens, table, None, q, interpret=True)
    with pytest.raises(ValueError, match="out must"):
        ragged_prefill_attention(q, k, k, qs, lens, table, jnp.ones((2,), bool), q[:4], interpret=True)


@pytest.mark.parametrize("mode", MODES)
def test_prefill_tile_major_launch_order(mode):
    """kv_heads_fastest=False (tile-major launch order) computes the same thing."""
    rng = np.random.default_rng(5)
    q, k, v, qs, lens, table = _batch(rng, [(7, 20), (1, 9)], 2, 8, 8, 2, 64, jnp.float32)
    out = ragged_prefill_attention(q, k, v, qs, lens, table, kv_heads_fastest=False,
                                   interpret=mode == "interpret")
    assert_close(out, ragged_prefill_attention_reference(q, k, v, qs, lens, table), jnp.float32, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 2)], ids=["in-place", "merged"])
def test_prefill_seq_mask_fills_in_out(mode, heads, kv_heads):
    """seq_mask + out: masked-in sequences (and padding) are computed, the others keep out's rows;
    in place when the layout allows (group a power of two), else merged."""
    rng = np.random.default_rng(9)
    q, k, v, qs, lens, table = _batch(rng, [(5, 9), (1, 20), (12, 12)], 3, 8, heads, kv_heads, 64, jnp.float32)
    mask = jnp.asarray([True, False, True])
    prev = jnp.full(q.shape, 7.0, q.dtype)
    out = ragged_prefill_attention(q, k, v, qs, lens, table, mask, prev, interpret=mode == "interpret")
    ref = ragged_prefill_attention_reference(q, k, v, qs, lens, table)
    keep = np.zeros(q.shape[0], bool)
    keep[5] = True  # sequence 1's token
    assert_close(out[~keep], ref[~keep], jnp.float32, mode)
    assert (np.asarray(out[keep]) == 7.0).all()
