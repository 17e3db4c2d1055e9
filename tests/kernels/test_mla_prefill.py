"""The ragged MLA kernels (pallas_kernels/attention/mla_prefill.py) against their jnp references: the absorbed form at
mixed lengths (decodes, chunks with context before them, a padding sequence), shuffled pages, key limits and a
sequence mask; the expanded form over each sequence's new tokens. Then `ModelOps.mla_attention` on the Pallas backend
(absorbed + expanded, merged by log-sum-exp) against the reference ops' jnp MLA (the absorbed form over the whole
context), and the kernels' CUDA lowering at DeepSeek's shapes. Interpret-mode grids are kept to a few programs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention.mla_prefill import (
    check_supported,
    merge_attention,
    mla_absorbed_attention,
    mla_absorbed_attention_reference,
    mla_expanded_attention,
    mla_expanded_attention_reference,
)
from tests.kernels.conftest import assert_close, by_mode, lower_for_cuda
from tests.kernels.test_mla_decode import paged_latent


def ragged(q_lens, num_tokens):
    qs = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    assert qs[-1] <= num_tokens
    return jnp.asarray(qs), int(qs[-1])


# (page_size, heads, rank, rope, dtype, context lens, new tokens, key limits (None: causal), block_h)
ABSORBED = [
    pytest.param(4, 4, 32, 8, jnp.float32, [13, 1, 20, 0], [5, 1, 20, 0], [8, 0, 20, 0], None, id="tiny-limits"),
    pytest.param(16, 16, 64, 16, jnp.bfloat16, [40, 3, 17], [9, 1, 17], None, None, id="h16-causal-bf16"),
    pytest.param(8, 64, 32, 16, jnp.float32, [30, 2], [4, 2], None, 32, id="h64-2blocks"),
]


@pytest.mark.parametrize("mode,page_size,heads,rank,rope,dtype,lens,q_lens,limits,block_h", by_mode(ABSORBED))
def test_absorbed_matches_reference(mode, page_size, heads, rank, rope, dtype, lens, q_lens, limits, block_h):
    rng = np.random.default_rng(page_size + heads + rank)
    num_tokens = sum(q_lens) + 3  # padding tokens after the last sequence
    latent, table = paged_latent(rng, lens, page_size, rank + rope, dtype, pages_per_seq=max(lens) // page_size + 2)
    qs, n = ragged(q_lens, num_tokens)
    q_lat = jnp.asarray(rng.standard_normal((num_tokens, heads, rank)), dtype)
    q_pe = jnp.asarray(rng.standard_normal((num_tokens, heads, rope)), dtype)
    lens_a = jnp.asarray(lens, jnp.int32)
    limit = lens_a if limits is None else jnp.asarray(limits, jnp.int32)
    args = (q_lat, q_pe, latent, qs, lens_a, table, limit)
    out, lse = mla_absorbed_attention(*args, scale=0.2, block_h=block_h, interpret=mode == "interpret")
    ref, ref_lse = mla_absorbed_attention_reference(*args, scale=0.2)
    assert_close(out[:n], ref[:n], dtype, mode)
    live = np.isfinite(np.asarray(ref_lse[:n]))  # a sequence whose limit leaves no key: -inf (and zeros)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse[:n])), live)
    np.testing.assert_allclose(np.asarray(lse[:n])[live], np.asarray(ref_lse[:n])[live], rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0)  # padding tokens: zeros


# (heads, nope, v, rank, rope, dtype, new tokens, seq_mask)
EXPANDED = [
    pytest.param(4, 16, 16, 32, 8, jnp.float32, [5, 1, 20, 0], None, id="tiny"),
    pytest.param(16, 32, 16, 64, 16, jnp.bfloat16, [70, 3, 9], [True, False, True], id="h16-masked-bf16"),
]


@pytest.mark.parametrize("mode,heads,nope,dv,rank,rope,dtype,q_lens,mask", by_mode(EXPANDED))
def test_expanded_matches_reference(mode, heads, nope, dv, rank, rope, dtype, q_lens, mask):
    rng = np.random.default_rng(heads + nope + sum(q_lens))
    num_tokens = sum(q_lens) + 2
    qs, n = ragged(q_lens, num_tokens)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s), dtype)  # noqa: E731
    args = (normal(num_tokens, heads, nope), normal(num_tokens, heads, rope), normal(num_tokens, heads, nope + dv),
            normal(num_tokens, rank + rope), qs)
    seq_mask = None if mask is None else jnp.asarray(mask)
    out, lse = mla_expanded_attention(*args, seq_mask, kv_lora_rank=rank, scale=0.3, interpret=mode == "interpret")
    ref, ref_lse = mla_expanded_attention_reference(*args, kv_lora_rank=rank, scale=0.3)
    rows = np.ones(n, bool) if mask is None else np.repeat(mask, q_lens)  # the masked-out sequences' rows: unspecified
    assert_close(out[:n][rows], ref[:n][rows], dtype, mode)
    np.testing.assert_allclose(np.asarray(lse[:n])[rows], np.asarray(ref_lse[:n])[rows], rtol=1e-3, atol=1e-3)


def test_merge_is_the_softmax_over_both_key_sets():
    """Two halves of one softmax (and a part without keys, whatever its rows hold) give the whole one."""
    rng = np.random.default_rng(0)
    s, v = rng.standard_normal((3, 10)), rng.standard_normal((10, 4))
    def part(lo, hi):
        p = np.exp(s[:, lo:hi] - s[:, lo:hi].max(1, keepdims=True))
        lse = (np.log(p.sum(1)) + s[:, lo:hi].max(1)) / np.log(2)
        return jnp.asarray((p / p.sum(1, keepdims=True)) @ v[lo:hi])[:, None], jnp.asarray(lse)[:, None]
    whole = part(0, 10)[0]
    np.testing.assert_allclose(merge_attention(*part(0, 4), *part(4, 10)), whole, rtol=1e-6)
    garbage, empty = jnp.full_like(whole, jnp.nan), jnp.full((3, 1), -jnp.inf)
    np.testing.assert_allclose(merge_attention(garbage, empty, *part(0, 10)), whole, rtol=1e-6)


def test_check_supported():
    latent = jax.ShapeDtypeStruct((64, 16, 576), jnp.bfloat16)
    assert check_supported(latent, 512, 128, 128) is None
    assert "v_dim" in check_supported(latent, 512, 128, 96)
    assert "page_size" in check_supported(jax.ShapeDtypeStruct((64, 12, 576), jnp.bfloat16), 512, 128, 128)
    assert "2**31" in check_supported(jax.ShapeDtypeStruct((1 << 17, 64, 576), jnp.bfloat16), 512, 128, 128)


def mla_case(rng, seqs, heads=4, nope=16, dv=16, rank=32, rope=8, page_size=4, num_tokens=48, num_seqs=None):
    """A random MLA layer's attention inputs over a step of `seqs` (new tokens, cached tokens, pages): the latent cache
    holding every sequence's context with this step's rows written, and those rows."""
    from jinfer.models.batch import make_batch
    from jinfer.models.deepseek import write_latent

    batch = make_batch([([1] * n, cached, pages) for n, cached, pages in seqs], page_size, num_tokens=num_tokens,
                       num_seqs=num_seqs or len(seqs) + 1, pages_per_seq=12)
    batch = jax.tree.map(jnp.asarray, batch)
    latent = jnp.asarray(rng.standard_normal((40, page_size, rank + rope)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((num_tokens, rank + rope)), jnp.float32)
    latent = write_latent(latent, rows, batch.slot_mapping)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)  # noqa: E731
    return (normal(num_tokens, heads, nope), normal(num_tokens, heads, rope), rows, normal(rank, heads, nope + dv),
            latent, batch)


def pallas_ops(**policy):
    from jinfer.config.kernels import KernelPolicy
    from jinfer.ops import ModelOps

    return ModelOps("pallas", interpret=True, policy=KernelPolicy(**policy))


def run_mla(ops, *args):
    return ops.mla_attention(*args, scale=0.25)


# A mixed step: a decode, a first chunk of 12, a later chunk of 10 after 17 cached tokens, a short chunk of 3 after 6.
MIXED = [(1, 20, [3, 9, 1, 14, 6, 8]), (12, 0, [12, 2, 5]), (10, 17, [20, 21, 7, 22, 23, 24, 25]),
         (3, 6, [30, 31, 32])]


def test_ops_mixed_step_matches_the_reference():
    """`ModelOps.mla_attention`, Pallas (interpreted): sequences with >= 8 new tokens take their own tokens expanded and
    the context before them absorbed, the others absorbed; the reference ops' jnp MLA gives the same rows. The jaxpr
    holds both kernels and not the reference; with the policy's switch off, the reference."""
    from jinfer.ops import REFERENCE_OPS

    args = mla_case(np.random.default_rng(1), MIXED)
    n = int(args[-1].query_start[-1])
    ops = pallas_ops(mla_expand_min_query_len=8)
    jaxpr = str(jax.make_jaxpr(run_mla, static_argnums=(0,))(ops, *args))
    assert "mla_absorbed_attention" in jaxpr and "mla_expanded_attention" in jaxpr
    assert "ragged_prefill_attention_reference" not in jaxpr
    want = run_mla(REFERENCE_OPS, *args)[:n]
    assert_close(run_mla(ops, *args)[:n], want, jnp.float32, "interpret")
    absorbed = pallas_ops(mla_expand_min_query_len=0)  # expansion off: every sequence absorbed
    assert "mla_expanded_attention" not in str(jax.make_jaxpr(run_mla, static_argnums=(0,))(absorbed, *args))
    assert_close(run_mla(absorbed, *args)[:n], want, jnp.float32, "interpret")
    off = str(jax.make_jaxpr(run_mla, static_argnums=(0,))(pallas_ops(mla_ragged_kernel=False), *args))
    assert "ragged_prefill_attention_reference" in off and "mla_absorbed" not in off


def test_ops_verify_and_decode_steps():
    """A verify step (<= 3 tokens a sequence, fewer than the policy's 4) takes the absorbed kernel only and matches the
    reference; a one-token step keeps the MLA decode kernel."""
    from jinfer.ops import REFERENCE_OPS

    args = mla_case(np.random.default_rng(2), [(3, 9, [4, 5, 6]), (2, 30, [7, 8, 9, 10, 11, 12, 13, 14, 15])],
                    num_tokens=8)
    verify = dataclasses.replace(pallas_ops(mla_expand_min_query_len=4), verify_query_len=3)  # T = 8 >= 4
    jaxpr = str(jax.make_jaxpr(run_mla, static_argnums=(0,))(verify, *args))
    assert "mla_absorbed_attention" in jaxpr and "mla_expanded" not in jaxpr
    assert_close(run_mla(verify, *args)[:5], run_mla(REFERENCE_OPS, *args)[:5], jnp.float32, "interpret")
    decode_args = mla_case(np.random.default_rng(3), [(1, 9, [4, 5, 6])], num_tokens=1, num_seqs=1)
    jaxpr = str(jax.make_jaxpr(run_mla, static_argnums=(0,))(pallas_ops(), *decode_args))
    assert "mla_decode_attention" in jaxpr and "mla_absorbed" not in jaxpr


@pytest.mark.parametrize("heads", [16, 128])
def test_lowers_for_cuda(heads):
    """DeepSeek-V2/V3's sizes (R 512, P 64, nope 128, v 128) through the Pallas Triton lowering (Triton IR on CPU)."""
    bf, i32 = jnp.bfloat16, jnp.int32
    S = jax.ShapeDtypeStruct
    text = lower_for_cuda(lambda *a: mla_absorbed_attention(*a, scale=0.1), S((64, heads, 512), bf),
                          S((64, heads, 64), bf), S((64, 16, 576), bf), S((5,), i32), S((4,), i32), S((4, 16), i32),
                          S((4,), i32), S((4,), bool))
    assert f"mla_absorbed_attention_bq{32 // min(heads, 32)}_h{min(heads, 32)}_bk64" in text
    text = lower_for_cuda(lambda *a: mla_expanded_attention(*a, kv_lora_rank=512, scale=0.1), S((256, heads, 128), bf),
                          S((256, heads, 64), bf), S((256, heads, 256), bf), S((256, 576), bf), S((5,), i32),
                          S((4,), bool))
    assert "mla_expanded_attention_bq64_h1_bk64" in text
