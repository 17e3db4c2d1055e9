"""norm_qkv_rope_write (input RMSNorm + q|k|v projection + q/k norm + RoPE + paged K/V write in one kernel)
vs its jnp reference."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.norm_qkv_rope import check_supported, norm_qkv_rope_write, norm_qkv_rope_write_reference
from tests.kernels.conftest import MODES, assert_close

# (tokens, hidden, heads, kv_heads, head_dim, page_size, qk_norm, dtype)
CASES = [
    pytest.param(1, 128, 4, 2, 64, 16, True, jnp.bfloat16, id="t1-qknorm-bf16"),
    pytest.param(5, 192, 2, 1, 32, 8, False, jnp.float32, id="t5-no-qknorm-f32"),
    pytest.param(17, 64, 2, 2, 32, 4, True, jnp.float32, id="t17-kvh-eq-h-f32"),
    pytest.param(3, 256, 4, 1, 128, 16, True, jnp.bfloat16, id="t3-d128-bf16"),
]


def _inputs(rng, tokens, hidden, heads, kv_heads, dim, page_size, qk_norm, dtype, num_pages=8):
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 2, dtype)
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype)
    w = jnp.asarray(rng.standard_normal((hidden, (heads + 2 * kv_heads) * dim)) * hidden**-0.5, dtype)
    pos = rng.integers(0, 500, tokens)
    inv = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
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
    return x, norm, w, cos, sin, jnp.asarray(slots), qn, kn, k_cache, v_cache


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("tokens,hidden,heads,kv_heads,dim,page_size,qk_norm,dtype", CASES)
def test_matches_reference(mode, splits, tokens, hidden, heads, kv_heads, dim, page_size, qk_norm, dtype):
    if hidden % (64 * splits):
        pytest.skip("K tiles do not split evenly")
    rng = np.random.default_rng(tokens * 100 + heads * 10 + dim)
    args = _inputs(rng, tokens, hidden, heads, kv_heads, dim, page_size, qk_norm, dtype)
    kw = dict(num_heads=heads, num_kv_heads=kv_heads, eps=1e-6)
    before_k = np.asarray(args[8].astype(jnp.float32))
    # split-K: the counters come back all zero (a buffer shared by the calls of a step)
    counters = None if splits == 1 else jnp.zeros((heads + 2 * kv_heads + 3,), jnp.int32)
    q, kc, vc, cnt = norm_qkv_rope_write(*args, counters, **kw, block_k=64, k_splits=None if splits == 1 else splits,
                                         interpret=mode == "interpret")
    if splits > 1:
        np.testing.assert_array_equal(np.asarray(cnt), 0)
    rq, rk, rv, _ = norm_qkv_rope_write_reference(*args, **kw)
    assert q.shape == (tokens, heads, dim) and q.dtype == dtype
    assert_close(q, rq, dtype, mode)
    assert_close(kc, rk, dtype, mode)
    assert_close(vc, rv, dtype, mode)
    # rows not written keep their contents exactly (padding wrote nothing)
    slots = np.asarray(args[5])
    written = np.zeros(before_k.shape[:2], bool).reshape(-1)
    written[slots[slots >= 0]] = True
    kept = ~written.reshape(before_k.shape[:2])
    np.testing.assert_array_equal(np.asarray(kc.astype(jnp.float32))[kept], before_k[kept])


def test_default_k_splits():
    from pallas_kernels.norm_qkv_rope import default_k_splits

    assert default_k_splits(48, 2560, 128) == 2  # Qwen3-4B: 96 programs
    assert default_k_splits(40, 2048, 128) == 2  # Qwen3-30B-A3B
    assert default_k_splits(24, 2048, 128) == 4
    assert default_k_splits(80, 4096, 128) == 1
    assert default_k_splits(24, 384, 128) == 1  # 3 K tiles do not split


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
