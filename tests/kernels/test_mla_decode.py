"""mla_decode_attention vs its jnp reference: head counts (one head block, several, padded), latent widths (reduced and
DeepSeek's 512 + 64, a small model's 8-wide RoPE key), page sizes below and above the token block, shuffled and wide
page tables, ragged and padding sequences, split-K on and off. Interpret-mode grids are kept to a few programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.mla_decode import (
    BLOCK_N,
    check_supported,
    mla_decode_attention,
    mla_decode_attention_reference,
    plan_heads,
    plan_splits,
)
from tests.kernels.conftest import MODES, assert_close, lower_for_cuda


def paged_latent(rng, lens, page_size: int, dim: int, dtype, *, pages_per_seq: int | None = None):
    """A random latent cache [pages, page_size, dim] and a shuffled page table [B, P] (unused entries page 0)."""
    need = [-(-n // page_size) for n in lens]
    pages_per_seq = pages_per_seq or max(1, max(need))
    num_pages = sum(need) + 2
    latent = jnp.asarray(rng.standard_normal((num_pages, page_size, dim)), dtype)
    perm, table, used = rng.permutation(num_pages), np.zeros((len(lens), pages_per_seq), np.int32), 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    return latent, jnp.asarray(table)


# (page_size, heads, rank, rope, dtype, lens, num_splits, block_h, block_n, pages_per_seq)
CASES = [
    pytest.param(16, 16, 64, 16, jnp.float32, [1, 17, 40, 0], 1, None, None, None, id="h16-nosplit-f32"),
    pytest.param(16, 16, 64, 16, jnp.bfloat16, [1, 33, 0, 100], 3, None, None, 16, id="h16-split3-bf16-wide-table"),
    pytest.param(8, 128, 32, 16, jnp.float32, [9, 30], None, 32, 16, None, id="h128-4blocks-auto"),
    pytest.param(64, 16, 64, 16, jnp.bfloat16, [70, 5], 2, None, 16, None, id="page64-above-block"),
    pytest.param(16, 16, 512, 64, jnp.bfloat16, [1, 50], 2, None, None, None, id="h16-512+64-split2"),
    pytest.param(4, 4, 32, 8, jnp.float32, [3, 13, 0], None, None, None, None, id="tiny-rope8-h4"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("page_size,heads,rank,rope,dtype,lens,splits,block_h,block_n,pps", CASES)
def test_mla_decode_matches_reference(mode, page_size, heads, rank, rope, dtype, lens, splits, block_h, block_n, pps):
    rng = np.random.default_rng(page_size * 1000 + heads + rank)
    latent, table = paged_latent(rng, lens, page_size, rank + rope, dtype, pages_per_seq=pps)
    q = jnp.asarray(rng.standard_normal((len(lens), heads, rank + rope)), dtype)
    seq_lens = jnp.asarray(lens, jnp.int32)
    scale = (rank // 4 + rope) ** -0.5  # a head dim below L, as DeepSeek's (nope + rope) ** -0.5
    out = mla_decode_attention(q, latent, table, seq_lens, kv_lora_rank=rank, scale=scale, num_splits=splits,
                               block_h=block_h, block_n=block_n, interpret=mode == "interpret")
    ref = mla_decode_attention_reference(q, latent, table, seq_lens, kv_lora_rank=rank, scale=scale)
    assert out.shape == (len(lens), heads, rank) and out.dtype == q.dtype
    assert_close(out, ref, dtype, mode)
    padding = np.asarray(lens) == 0
    if padding.any():
        assert not np.asarray(out[padding].astype(jnp.float32)).any()


def test_reference_is_expanded_attention():
    """The reference against attention written out per head (keys [c | k_pe], values c), a softmax per sequence."""
    rng = np.random.default_rng(3)
    lens = [5, 12]
    latent, table = paged_latent(rng, lens, 4, 24, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 3, 24)), jnp.float32)
    ref = mla_decode_attention_reference(q, latent, table, jnp.asarray(lens), kv_lora_rank=16, scale=0.3)
    for b, n in enumerate(lens):
        rows = np.asarray(latent)[np.asarray(table[b])].reshape(-1, 24)[:n]  # [n, L] in token order
        s = 0.3 * np.asarray(q[b]) @ rows.T  # [H, n]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        np.testing.assert_allclose(np.asarray(ref[b]), (p / p.sum(1, keepdims=True)) @ rows[:, :16], rtol=1e-5,
                                   atol=1e-5)


def test_launch_plan():
    """All heads in one program up to 16 (32 above); split-K only while head blocks x batch leave the GPU short."""
    assert plan_heads(16) == (16, 16)  # DeepSeek-V2-Lite, V3 at tp = 8
    assert plan_heads(2) == (2, 16)  # V2-Lite at tp = 8: rows padded to a tensor-core tile
    assert plan_heads(128) == (32, 32)  # V3 at tp = 1: 4 head blocks
    assert plan_heads(48, 32) == (16, 16)
    assert plan_splits(32, 128, None) == 9  # V2-Lite batch 32 x 4k: 288 programs
    assert plan_splits(32 * 4, 128, None) == 3
    assert plan_splits(256, 128, None) == 1
    assert plan_splits(1, 128, None) == 64  # batch 1: capped at MAX_SPLITS
    assert plan_splits(1, 5, None) == 5  # ... and at the table's blocks


def test_argument_checks():
    q, latent = jnp.zeros((2, 16, 80)), jnp.zeros((4, 16, 80))
    table, lens = jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32)
    kw = dict(kv_lora_rank=64, scale=0.1, interpret=True)
    with pytest.raises(ValueError, match="latent"):
        mla_decode_attention(jnp.zeros((2, 16, 72)), latent, table, lens, **kw)
    with pytest.raises(ValueError, match="powers of two"):
        mla_decode_attention(q, latent, table, lens, **(kw | dict(kv_lora_rank=48)))
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode_attention(q, latent, table, jnp.ones((3,), jnp.int32), **kw)
    with pytest.raises(ValueError, match="page_table"):
        mla_decode_attention(q, latent, jnp.zeros((3, 2), jnp.int32), lens, **kw)
    with pytest.raises(ValueError, match="block_n"):
        mla_decode_attention(q, latent, table, lens, block_n=24, **kw)
    huge = jax.ShapeDtypeStruct((1 << 17, 64, 576), jnp.bfloat16)  # 4.8e9 values: int32 offsets would wrap
    assert "2**31" in check_supported(jax.ShapeDtypeStruct((2, 16, 576), jnp.bfloat16), huge, 512)


def test_ops_choose_the_kernel_for_decode_steps():
    """`ModelOps.latent_attention`: a decode-only step (one token per sequence, a padding sequence last) takes the
    kernel with the policy's launch arguments and gives the reference ops' rows; a prefill step, or a latent width
    the kernel does not take, stays on the reference."""
    from jinfer.config.kernels import KernelPolicy
    from jinfer.models.batch import make_batch
    from jinfer.ops import REFERENCE_OPS, ModelOps

    rng = np.random.default_rng(5)
    latent = jnp.asarray(rng.standard_normal((16, 4, 40)), jnp.float32)  # R = 32, a 8-wide RoPE key
    policy = KernelPolicy().with_launch("mla_decode_attention", num_splits=2, block_n=16)
    ops = ModelOps("pallas", interpret=True, decode_step=True, policy=policy)
    batch = make_batch([([5], 20, [3, 9, 1, 14, 6, 8]), ([7], 4, [12, 2])], 4, num_tokens=3, num_seqs=3,
                       pages_per_seq=8)
    q = jnp.asarray(rng.standard_normal((3, 4, 40)), jnp.float32)

    def run(ops, q, latent, batch, rank=32):
        return ops.latent_attention(q, latent, batch, 0.2, rank)

    assert "mla_decode_attention_h16_n16_s2" in str(jax.make_jaxpr(run, static_argnums=(0,))(ops, q, latent, batch))
    got = run(ops, q, latent, batch)
    assert_close(got[:2], run(REFERENCE_OPS, q, latent, batch)[:2], jnp.float32, "interpret")
    prefill = make_batch([([5, 6, 7], 0, [3])], 4, num_tokens=3, num_seqs=1, pages_per_seq=4)
    prefill_ops = ModelOps("pallas", interpret=True)
    assert "mla_decode" not in str(jax.make_jaxpr(run, static_argnums=(0,))(prefill_ops, q, latent, prefill))
    odd = jax.make_jaxpr(run, static_argnums=(0, 4))(ops, q, latent, batch, 24)  # R = 24: not a power of two
    assert "mla_decode" not in str(odd)


@pytest.mark.parametrize("heads,rank,rope,splits", [(16, 512, 64, 1), (16, 512, 64, 4), (128, 512, 64, 1),
                                                   (4, 32, 8, 2)])
def test_lowers_for_cuda(heads, rank, rope, splits):
    """DeepSeek's shapes, and a tiny model's 8-wide RoPE key (the padded gather), through the Pallas Triton lowering
    (Triton IR on CPU; PTX needs the GPU)."""
    L = rank + rope
    shapes = (jax.ShapeDtypeStruct((4, heads, L), jnp.bfloat16), jax.ShapeDtypeStruct((64, 16, L), jnp.bfloat16),
              jax.ShapeDtypeStruct((4, 16), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    text = lower_for_cuda(lambda *a: mla_decode_attention(*a, kv_lora_rank=rank, scale=0.1, num_splits=splits),
                          *shapes)
    assert f"mla_decode_attention_h{32 if heads > 16 else 16}_n{BLOCK_N}_s{splits}" in text
