"""qkv_rope_write (q/k RMSNorm + RoPE + paged K/V write in one kernel) vs its jnp reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.dense.qkv_rope import check_supported, qkv_rope_write, qkv_rope_write_reference
from tests.kernels.conftest import assert_close, assert_unwritten_rows_kept, by_mode, fp8_kv

# (tokens, heads, kv_heads, head_dim, page_size, qk_norm, dtype, gated_q, rotary_dim)
CASES = [
    pytest.param(1, 8, 2, 64, 16, True, jnp.bfloat16, False, None, id="t1-qknorm-bf16"),
    pytest.param(5, 4, 4, 16, 8, False, jnp.float32, False, None, id="t5-norope-norm-f32"),
    pytest.param(7, 6, 2, 32, 4, True, jnp.float32, False, None, id="t7-h6-qknorm-f32"),
    pytest.param(3, 2, 2, 128, 16, True, jnp.bfloat16, False, None, id="t3-kvh-eq-h-bf16"),
    # Qwen3.5's gated attention: each head's query next to its gate, a quarter of each head rotated
    pytest.param(3, 4, 2, 64, 8, True, jnp.float32, True, 16, id="t3-gated-partial-f32"),
    pytest.param(1, 8, 2, 128, 16, True, jnp.bfloat16, True, 32, id="t1-gated-partial-bf16"),
    pytest.param(4, 2, 1, 32, 4, True, jnp.float32, False, 8, id="t4-partial-f32"),
]


def _inputs(rng, tokens, heads, kv_heads, dim, page_size, qk_norm, dtype, num_pages=6, gated_q=False, rotary=None):
    qkv = jnp.asarray(rng.standard_normal((tokens, ((2 if gated_q else 1) * heads + 2 * kv_heads) * dim)) * 2, dtype)
    pos = rng.integers(0, 500, tokens)
    rotary = rotary or dim
    inv = 1.0 / (10000 ** (np.arange(0, rotary, 2) / rotary))
    emb = np.concatenate([pos[:, None] * inv] * 2, axis=-1)
    cos, sin = jnp.asarray(np.cos(emb), dtype), jnp.asarray(np.sin(emb), dtype)
    # distinct slots in pages 1.., the last token padding (slot -1) when there are several
    slots = rng.permutation(np.arange(page_size, num_pages * page_size))[:tokens].astype(np.int32)
    if tokens > 1:
        slots[-1] = -1
    qn = jnp.asarray(1 + 0.1 * rng.standard_normal(dim), dtype) if qk_norm else None
    kn = jnp.asarray(1 + 0.1 * rng.standard_normal(dim), dtype) if qk_norm else None
    shape = (num_pages, page_size, kv_heads, dim)
    k_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    v_cache = jnp.asarray(rng.standard_normal(shape), dtype)
    return qkv, cos, sin, jnp.asarray(slots), qn, kn, k_cache, v_cache


# The interpreter (one compile per case) leaves out t1-qknorm-bf16 (bf16 with q/k norms, one token, GQA 4: as
# t1-gated-partial-bf16, whose gate and partial rotation add to it; full RoPE with q/k norms: t7-h6-qknorm-f32) and
# t3-kvh-eq-h-bf16 (one query head per K/V head: t5-norope-norm-f32; head_dim 128: t1-gated-partial-bf16).
INTERPRET_CASES = [c for c in CASES if c.id not in ("t1-qknorm-bf16", "t3-kvh-eq-h-bf16")]


@pytest.mark.parametrize("mode,tokens,heads,kv_heads,dim,page_size,qk_norm,dtype,gated_q,rotary",
                         by_mode(INTERPRET_CASES, CASES))
def test_matches_reference(mode, tokens, heads, kv_heads, dim, page_size, qk_norm, dtype, gated_q, rotary):
    rng = np.random.default_rng(tokens * 100 + heads * 10 + dim)
    args = _inputs(rng, tokens, heads, kv_heads, dim, page_size, qk_norm, dtype, gated_q=gated_q, rotary=rotary)
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-6, gated_q=gated_q)
    before_k, before_v = np.asarray(args[6].astype(jnp.float32)), np.asarray(args[7].astype(jnp.float32))
    q, kc, vc = qkv_rope_write(*args, **kw, interpret=mode == "interpret")
    rq, rk, rv = qkv_rope_write_reference(*args, **kw)
    assert q.shape == (tokens, heads, dim) and q.dtype == dtype
    assert_close(q, rq, dtype, mode)
    assert_close(kc, rk, dtype, mode)
    assert_close(vc, rv, dtype, mode)
    assert_unwritten_rows_kept(args[3], (kc, before_k), (vc, before_v))  # padding wrote nothing
    slots = np.asarray(args[3])
    # v rows are copied bit for bit
    for t, s in enumerate(slots):
        if s >= 0:
            v_new = args[0][t].reshape(-1, dim)[(2 if gated_q else 1) * heads + kv_heads:]
            np.testing.assert_array_equal(np.asarray(vc[s // page_size, s % page_size]), np.asarray(v_new))


def assert_fp8_rows_close(cache, ref, scale):
    """Two FP8 caches' values (times their kv head's scale) within one e4m3 step: the rows were rounded to the
    activation dtype in slightly different ways before their quantization."""
    got, want = (np.asarray(c.astype(jnp.float32)) * np.asarray(scale)[:, None] for c in (cache, ref))
    np.testing.assert_allclose(got, want, rtol=2.0**-3, atol=2.0**-9 * float(np.max(scale)))


@pytest.mark.parametrize("mode,dtype", by_mode([pytest.param(jnp.bfloat16, id="gated-partial-bf16")]))
def test_fp8_cache_rows_quantized(mode, dtype):
    """An FP8 cache: the new K rows (normed, rotated: partial RoPE writes its passing dims apart) and V rows divided
    by their kv head's scale and rounded to e4m3 as the reference does; padding writes nothing."""
    rng = np.random.default_rng(31)
    args = _inputs(rng, 3, 4, 2, 64, 8, True, dtype, gated_q=True, rotary=16)
    k8, v8, ks, vs = fp8_kv(rng, args[6], args[7])
    args = (*args[:6], k8, v8, ks, vs)
    kw = dict(num_heads=4, num_kv_heads=2, eps=1e-6, gated_q=True)
    before = [np.asarray(c.astype(jnp.float32)) for c in (k8, v8)]
    q, kc, vc = qkv_rope_write(*args, **kw, interpret=mode == "interpret")
    rq, rk, rv = qkv_rope_write_reference(*args, **kw)
    assert kc.dtype == vc.dtype == jnp.float8_e4m3fn
    assert_close(q, rq, dtype, mode)
    assert_fp8_rows_close(kc, rk, ks)
    np.testing.assert_array_equal(np.asarray(vc.astype(jnp.float32)), np.asarray(rv.astype(jnp.float32)))
    assert_unwritten_rows_kept(args[3], (kc, before[0]), (vc, before[1]))


def test_unsupported_shapes():
    assert check_supported(3 * 4 * 24, 4, 4, 24) is not None  # head_dim not a power of two
    assert check_supported(100, 4, 2, 16) is not None
    assert check_supported((8 + 4) * 64, 8, 2, 64) is None
    assert check_supported((16 + 4) * 64, 8, 2, 64, gated_q=True, rotary_dim=16) is None
    assert check_supported((8 + 4) * 64, 8, 2, 64, gated_q=True) is not None  # no room for the gates
    assert check_supported((8 + 4) * 64, 8, 2, 64, rotary_dim=24) is not None  # not a power of two
    with pytest.raises(ValueError, match="head_dim"):
        z = jnp.zeros((1, 3 * 24))
        qkv_rope_write(z, jnp.zeros((1, 24)), jnp.zeros((1, 24)), jnp.zeros((1,), jnp.int32), None, None,
                       jnp.zeros((2, 4, 1, 24)), jnp.zeros((2, 4, 1, 24)), num_heads=1, num_kv_heads=1,
                       interpret=True)
