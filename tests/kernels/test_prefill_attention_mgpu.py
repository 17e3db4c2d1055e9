"""ragged_prefill_attention_mgpu (Mosaic GPU: TMA + wgmma) vs the jnp reference on mixed batches.

"interpret" runs jax's Mosaic GPU interpreter on CPU (threads, SMEM, barriers and TMA simulated);
"gpu" compiles for the H100. Shapes stay small: the interpreter runs each warpgroup as a thread.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.prefill_attention import ragged_prefill_attention_reference
from pallas_kernels.attention.prefill_attention_mgpu import check_supported, ragged_prefill_attention_mgpu
from tests.kernels.conftest import MODES, assert_close, by_mode, paged_kv
from tests.kernels.test_prefill_attention import _batch

# seqs: (new tokens, context length incl. them); (0, 0) is a padding sequence
GPU_CASES = [
    pytest.param(16, 8, 2, 128, [(17, 17), (3, 40), (1, 16), (16, 33)], 2, {}, id="p16-g4-d128"),
    pytest.param(8, 4, 4, 64, [(1, 1), (8, 8), (9, 9), (5, 20), (1, 30), (0, 0)], 3, {}, id="p8-g1-d64"),
    pytest.param(64, 16, 2, 64, [(65, 65), (1, 100), (10, 74), (0, 0)], 0, {}, id="p64-g8-d64"),
    # K/V ring wraps around (5 blocks of 64 through 3 slots); 129 = two tiles + 1 token
    pytest.param(16, 8, 2, 128, [(129, 300), (1, 17)], 1, {"block_kv": 64, "max_steps": 3}, id="ring-wrap"),
    pytest.param(16, 4, 2, 256, [(20, 20), (1, 17)], 1, {}, id="p16-g2-d256"),
]
# The interpreter runs every (head, tile) item, so its cases keep few heads (its time grows with them); which case
# covers what: ragged decodes / short prefills / a padding sequence / padding tokens / no GQA / 8-row pages
# (p8-g1-d64); pages of 64 rows, 2 per K/V block (p64-g2-d64); the ring wrapping at an odd depth, head_dim 128, GQA
# group 4, an odd CTA count with a spare slot in the last round (ring-wrap-3ctas); head_dim 256's blocks
# (p16-g2-d256); the default blocks with several q tiles and pages of 16 at head_dim 128: test_mgpu_prefill_long_chunk.
INTERPRET_CASES = [
    pytest.param(8, 2, 2, 64, [(1, 1), (8, 8), (9, 9), (5, 20), (1, 30), (0, 0)], 3, {}, id="p8-g1-d64"),
    pytest.param(64, 2, 1, 64, [(65, 65), (1, 100), (10, 74), (0, 0)], 0, {}, id="p64-g2-d64"),
    pytest.param(16, 4, 1, 128, [(129, 300), (1, 17)], 1, {"block_kv": 64, "max_steps": 3, "num_ctas": 3},
                 id="ring-wrap-3ctas"),
    pytest.param(16, 2, 1, 256, [(20, 20), (1, 17)], 1, {}, id="p16-g2-d256"),
]


@pytest.mark.parametrize("mode,page_size,heads,kv_heads,dim,seqs,pad,blocks", by_mode(INTERPRET_CASES, GPU_CASES))
def test_mgpu_prefill_matches_reference(mode, page_size, heads, kv_heads, dim, seqs, pad, blocks):
    rng = np.random.default_rng(len(seqs) * 100 + dim + page_size)
    q, k, v, qs, lens, table = _batch(rng, seqs, pad, page_size, heads, kv_heads, dim, jnp.bfloat16)
    out = ragged_prefill_attention_mgpu(q, k, v, qs, lens, table, interpret=mode == "interpret", **blocks)
    ref = ragged_prefill_attention_reference(q, k, v, qs, lens, table)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, jnp.bfloat16, mode)
    real = int(qs[-1])
    assert not np.asarray(out[real:].astype(jnp.float32)).any(), "padding tokens must be zeros"


@pytest.mark.parametrize("num_ctas", [1, 64])
def test_mgpu_prefill_persistent_grid(num_ctas):
    """Any number of persistent CTAs: one CTA walking every item (its K/V ring running on across
    items), more CTAs than items. (An odd count, snake order with a spare slot in the last round: the
    ring-wrap-3ctas case above.)"""
    rng = np.random.default_rng(num_ctas)
    seqs = [(130, 200), (1, 17), (40, 40), (0, 0)]
    q, k, v, qs, lens, table = _batch(rng, seqs, 3, 16, 2, 1, 64, jnp.bfloat16)
    out = ragged_prefill_attention_mgpu(q, k, v, qs, lens, table, interpret=True, block_kv=64, max_steps=2,
                                        num_ctas=num_ctas)
    ref = ragged_prefill_attention_reference(q, k, v, qs, lens, table)
    assert_close(out, ref, jnp.bfloat16, "interpret")


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_mgpu_prefill_long_chunk(mode):
    """At the default blocks (64-row q tiles, 128-row K/V steps through a ring of 2): a 150-token chunk after 380
    cached tokens (3 q tiles, 5 K/V steps: the ring wraps twice) next to a fresh 130-token prompt and two decodes.
    (The interpreter's time grows with heads x tiles x steps: a larger chunk checks nothing more, and it gets 4 heads
    of one K/V head, the GPU 8 of 2.)"""
    rng = np.random.default_rng(3)
    seqs = [(150, 530), (130, 130), (1, 260), (1, 64)]
    heads, kv_heads = (4, 1) if mode == "interpret" else (8, 2)
    q, k, v, qs, lens, table = _batch(rng, seqs, 11, 16, heads, kv_heads, 128, jnp.bfloat16)
    out = ragged_prefill_attention_mgpu(q, k, v, qs, lens, table, interpret=mode == "interpret")
    ref = ragged_prefill_attention_reference(q, k, v, qs, lens, table)
    assert_close(out, ref, jnp.bfloat16, mode)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [m for m in MODES if m.id == "gpu"])
@pytest.mark.parametrize("n", [1024, 2048])
def test_mgpu_prefill_causal_single_sequence(mode, n):
    """The benchmark's shape: one fresh causal prompt, Qwen3-4B heads, fp16 and bf16, against XLA's
    dot_product_attention on the contiguous K/V (the gathering reference needs O(n^2 D) memory)."""
    import jax

    rng = np.random.default_rng(n)
    for dtype in (jnp.bfloat16, jnp.float16):
        k, v, table = paged_kv(rng, [n], 16, 8, 128, dtype, extra_pages=0)
        q = jnp.asarray(rng.standard_normal((n, 32, 128)), dtype)
        qs, lens = jnp.asarray([0, n], jnp.int32), jnp.asarray([n], jnp.int32)
        out = ragged_prefill_attention_mgpu(q, k, v, qs, lens, table)
        kc, vc = (c[table[0]].reshape(1, n, 8, 128) for c in (k, v))
        ref = jax.nn.dot_product_attention(q[None], kc, vc, is_causal=True, implementation="xla")[0]
        assert_close(out, ref, dtype, mode)


def test_mgpu_prefill_argument_checks():
    q = jnp.zeros((5, 8, 64), jnp.bfloat16)
    table = jnp.zeros((1, 2), jnp.int32)
    qs, lens = jnp.asarray([0, 5], jnp.int32), jnp.asarray([5], jnp.int32)
    with pytest.raises(ValueError, match="head_dim"):
        k = jnp.zeros((4, 16, 2, 96), jnp.bfloat16)
        ragged_prefill_attention_mgpu(jnp.zeros((5, 8, 96), jnp.bfloat16), k, k, qs, lens, table, interpret=True)
    k = jnp.zeros((4, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="dtype"):
        ragged_prefill_attention_mgpu(q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32), qs,
                                      lens, table, interpret=True)
    with pytest.raises(ValueError, match="max_steps"):
        ragged_prefill_attention_mgpu(q, k, k, qs, lens, table, max_steps=1, interpret=True)
    with pytest.raises(ValueError, match="num_ctas"):
        ragged_prefill_attention_mgpu(q, k, k, qs, lens, table, num_ctas=0, interpret=True)
    with pytest.raises(ValueError, match="SMEM"):
        ragged_prefill_attention_mgpu(q, k, k, qs, lens, table, block_kv=256, max_steps=8, interpret=True)
    with pytest.raises(ValueError, match="query_start"):
        ragged_prefill_attention_mgpu(q, k, k, qs[:1], lens, table, interpret=True)
    assert check_supported(q, jnp.zeros((4, 4, 2, 64), jnp.bfloat16)) is not None  # page size 4
    assert check_supported(q, k) is None
    assert "FP8 cache goes to the Triton kernel" in check_supported(q, k.astype(jnp.float8_e4m3fn))


def test_ops_send_fp8_caches_to_the_triton_kernel():
    """With the Mosaic prefill on, a step of long sequences over an FP8 cache runs the Triton kernel (its FP8 form)
    only (traced: no kernel runs)."""
    import jax

    from jinfer.config.kernels import KernelPolicy
    from jinfer.models.batch import make_batch
    from jinfer.ops import ModelOps

    policy = KernelPolicy()
    n = max(policy.mosaic_min_query_len, policy.mosaic_min_step_tokens)
    batch = make_batch([([0] * n, 0, list(range(1, n // 16 + 1)))], 16, num_tokens=n, num_seqs=2)
    cache = jnp.zeros((n // 16 + 1, 16, 2, 64), jnp.float8_e4m3fn)
    scales = jnp.ones((2,), jnp.float32)
    q = jnp.zeros((n, 8, 64), jnp.bfloat16)
    ops = ModelOps("pallas", interpret=False, mosaic_prefill=True)
    jaxpr = str(jax.make_jaxpr(lambda q: ops.attention(q, cache, cache, batch, 0.125, scales, scales))(q))
    assert "ragged_prefill_attention_bq" in jaxpr and "_fp8" in jaxpr and "wgmma" not in jaxpr


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_ops_split_sends_long_sequences_to_mosaic(mode):
    """ModelOps with mosaic_prefill: sequences with >= mosaic_min_query_len new tokens take the Mosaic
    kernel, decodes / short chunks / padding the Triton kernel; the merged rows match the reference."""
    from jinfer.config.kernels import KernelPolicy
    from jinfer.models.batch import make_batch
    from jinfer.ops import REFERENCE_OPS, ModelOps

    policy = KernelPolicy()
    MOSAIC_MIN_QUERY_LEN, MOSAIC_MIN_STEP_TOKENS = policy.mosaic_min_query_len, policy.mosaic_min_step_tokens
    rng = np.random.default_rng(11)
    page, kv_heads, heads, dim = (16, 1, 2, 64) if mode == "interpret" else (16, 2, 8, 64)
    seqs = [(1, 40), (MOSAIC_MIN_QUERY_LEN + 3, MOSAIC_MIN_QUERY_LEN + 50), (20, 60), (MOSAIC_MIN_QUERY_LEN, 200)]
    need = [-(-c // page) for _, c in seqs]
    shape = (sum(need) + 1, page, kv_heads, dim)  # page 0 is reserved
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16) for _ in range(2))
    ids = (rng.permutation(sum(need)) + 1).tolist()
    pages = [ids[sum(need[:b]):sum(need[:b + 1])] for b in range(len(seqs))]
    num_tokens = max(sum(n for n, _ in seqs) + 5, MOSAIC_MIN_STEP_TOKENS)
    batch = make_batch([([0] * n, c - n, pages[b]) for b, (n, c) in enumerate(seqs)], page,
                       num_tokens=num_tokens, num_seqs=len(seqs) + 1)
    q = jnp.asarray(rng.standard_normal((num_tokens, heads, dim)), jnp.bfloat16)
    ops = ModelOps("pallas", interpret=mode == "interpret", mosaic_prefill=True)
    out = ops.attention(q, k, v, batch, dim**-0.5)
    ref = REFERENCE_OPS.attention(q, k, v, batch, dim**-0.5)
    assert_close(out, ref, jnp.bfloat16, mode)
    import jax

    jaxpr = str(jax.make_jaxpr(lambda q: ops.attention(q, k, v, batch, dim**-0.5))(q))
    assert "ragged_prefill_attention_bq" in jaxpr and "wgmma" in jaxpr, "both kernels must run"


@pytest.mark.parametrize("dim,page,blocks", [(128, 16, {}), (128, 16, {"max_steps": 2, "q_buffers": 2}),
                                              (64, 8, {"block_kv": 64, "max_steps": 2}), (256, 64, {})],
                         ids=["d128-p16", "d128-p16-2q", "d64-p8", "d256-p64"])
def test_mgpu_prefill_lowers_for_cuda(dim, page, blocks):
    """Mosaic GPU's own compile steps (layout inference, TMA legality) run at lowering: exporting for
    CUDA checks them on a machine without a GPU (the interpreter does not)."""
    import jax
    from jax import export

    heads, kv_heads, tokens, batch = 8, 2, 300, 3
    s = jax.ShapeDtypeStruct
    kv = s((tokens // page + 4, page, kv_heads, dim), jnp.bfloat16)
    fn = jax.jit(lambda *a: ragged_prefill_attention_mgpu(*a, min_query_len=128, **blocks))
    exp = export.export(fn, platforms=["cuda"])(
        s((tokens, heads, dim), jnp.bfloat16), kv, kv, s((batch + 1,), jnp.int32), s((batch,), jnp.int32),
        s((batch, tokens // page + 1), jnp.int32))
    assert "mosaic_gpu" in exp.mlir_module()
