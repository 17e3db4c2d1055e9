"""Tiny random-weight Llama / Qwen2 / Qwen3 / Qwen3-MoE checkpoints against HF transformers' own logits.

The goldens (tests/data/golden/tiny-*.npz) come from scripts/make_golden.py running HF
transformers on the same safetensors; nothing here runs PyTorch. Pages are deliberately small and
handed out in scrambled order so every sequence spans several non-contiguous pages.

Every step is padded to one of two shapes, as the engine pads to its buckets: a prefill step (PREFILL_*)
and a one-token decode step, both PAGES_PER_SEQ pages wide. Each model then compiles twice; a compile costs
far more than a step on CPU (one per prompt length made this file several times slower).
"""

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.moe.moe_router as moe_router
from jinfer.config.kernels import KernelPolicy
from jinfer.models.batch import make_batch
from jinfer.models.registry import forward, fuse_qkv
from jinfer.ops import REFERENCE_OPS, ModelOps
from jinfer.weights.loader import load_weights, resolve_model

from ..conftest import DATA

PAGE = 4
NUM_PAGES = 64
# The prefill bucket: the longest prompt (37 tokens) or the chunked steps' three sequences (<= 43 tokens) fit
PREFILL_TOKENS, PREFILL_SEQS = 48, 4
PAGES_PER_SEQ = 18  # every step's page table: the longest prompt and its 32 decodes, (37 + 32) // PAGE + 1
ATOL = 2e-4  # float32 vs PyTorch float32: differences are summation-order noise


def load(arch):
    src = resolve_model(DATA / f"tiny-{arch}")
    return src.config, load_weights(src, "float32", progress=False), np.load(DATA / "golden" / f"tiny-{arch}.npz")


def empty_cache(cfg):
    shape = (NUM_PAGES, PAGE, cfg.num_kv_heads, cfg.head_dim)
    return tuple((jnp.zeros(shape), jnp.zeros(shape)) for _ in range(cfg.num_layers))


def placed_as_outputs(kv, w):
    """A fresh one-device cache placed as the step returns it (replicated over the weights' mesh): it would otherwise
    be another input signature than a returned one, and compile the same step twice. (A cache already placed on a
    mesh, as the sharded tests make it, is left as it is.)"""
    if isinstance(jax.tree.leaves(kv)[0].sharding, jax.sharding.NamedSharding):
        return kv
    mesh = jax.tree.leaves(w)[0].sharding.mesh
    return jax.device_put(kv, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def scrambled_pages(seed, n):
    return [int(p) + 1 for p in np.random.default_rng(seed).permutation(NUM_PAGES - 1)[:n]]  # page 0 is reserved


def prefill_batch(seqs):
    """The prefill bucket's batch of (new tokens, cached tokens, pages) per sequence, with the logits of every row
    (padding rows included, so the logits' shape is the bucket's too): the caller slices the real ones."""
    batch = make_batch(seqs, PAGE, num_tokens=PREFILL_TOKENS, num_seqs=PREFILL_SEQS, pages_per_seq=PAGES_PER_SEQ)
    return replace(batch, logits_indices=np.arange(PREFILL_TOKENS, dtype=np.int32))


def decode_batch(token, position, pages):
    return make_batch([([token], position, pages)], PAGE, pages_per_seq=PAGES_PER_SEQ)


# The Pallas kernels run in the Pallas interpreter here; natively on GPU (see tests/kernels).
OPS = {"ref": REFERENCE_OPS, "pallas": ModelOps("pallas", interpret=jax.default_backend() != "gpu")}


ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")
# Kernel policies beyond the defaults, each on one Pallas case (the defaults stay on the others and in the engines):
# qwen3: the norm + q|k|v kernel's idle programs read half of the o weight into L2 (`prefetch_o`); qwen3_moe: a MoE
# block's norm + router + routing as one Pallas kernel (`moe_norm_route`) for every step it takes, prefill chunks
# too (`moe_front_max_tokens`; at the default, steps of more than 8 tokens take the separate kernels, as in
# tests/models/test_moe_engine.py's Pallas engine).
POLICIES = {"qwen3": dict(prefetch_o=0.5), "qwen3_moe": dict(moe_front_max_tokens=moe_router.MAX_TOKENS)}


def make_step(arch, ops):
    """The model's weights (q/k/v fused for the Pallas kernels, as the engine does on one device) and its jitted step,
    with the arch's kernel policy on the Pallas case."""
    cfg, w, gold = load(arch)
    ops = OPS[ops]
    if ops.backend == "pallas":
        w = fuse_qkv(cfg, w)
        if arch in POLICIES:
            ops = replace(ops, policy=KernelPolicy(**POLICIES[arch]))
    return cfg, w, gold, jax.jit(partial(forward, cfg=cfg, ops=ops), donate_argnames=("kv_cache",))


@pytest.fixture(scope="module", params=[pytest.param((a, o), id=f"{a}-{o}", marks=[pytest.mark.slow] * (o == "pallas"))
                                        for a in ARCHS for o in OPS])
def model(request):
    arch, ops = request.param
    cfg, w, gold, step = make_step(arch, ops)
    if ops == "pallas":  # also covers the fused q/k/v projection the engine uses on one device
        assert w.layers[0].wq is None and w.layers[0].wqkv is not None
    return cfg, w, gold, step


@pytest.mark.parametrize("arch", POLICIES)
def test_kernel_policy_took_effect(arch):
    """The policies above changed the kernels the Pallas step runs (its jaxpr, traced only): the o prefetch in the
    norm + q|k|v kernel, the fused MoE front on a decode step and on a prefill-bucket step."""
    cfg, w, _, step = make_step(arch, "pallas")
    decode = str(jax.make_jaxpr(step)(w, decode_batch(1, 20, scrambled_pages(0, 8)), empty_cache(cfg)))
    if arch == "qwen3":
        assert "_pf" in decode.split("norm_qkv_rope_write_k", 1)[1][:20]
    else:
        prefill = str(jax.make_jaxpr(step)(w, prefill_batch([(list(range(3, 40)), 0, scrambled_pages(0, 10))]),
                                           empty_cache(cfg)))
        assert moe_router.MAX_TOKENS >= PREFILL_TOKENS
        assert "moe_norm_route" in decode and "moe_norm_route" in prefill


def test_config_read_from_hf(model):
    cfg, w, gold, _ = model
    assert cfg.num_kv_heads < cfg.num_heads  # GQA is exercised
    if cfg.architecture == "llama":
        assert cfg.rope_scaling.rope_type == "llama3" and not cfg.tie_word_embeddings
    if cfg.architecture == "qwen2":
        assert cfg.attention_bias and cfg.tie_word_embeddings
    if cfg.architecture in ("qwen3", "qwen3_moe"):
        assert cfg.qk_norm and cfg.head_dim * cfg.num_heads != cfg.hidden_size
    if cfg.architecture == "qwen3_moe":  # transformers 5 writes num_local_experts; experts per layer stacked
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.mlp_only_layers) == (8, 2, (1,))
        assert [cfg.is_moe_layer(i) for i in range(3)] == [True, False, True]
        assert w.layers[0].w_gate.shape == (8, 64, 32) and w.layers[0].router.shape == (64, 8)
        assert w.layers[1].router is None and w.layers[1].w_gate.shape == (64, 96)


def test_prefill_and_every_decode_step_match_hf(model):
    """Every prompt with the reference ops; with the Pallas kernels (interpreted: their steps run slowly) the first
    one's decodes, the others' prefills in the batched chunked prefill test."""
    cfg, w, gold, step = model
    for i in range(3) if w.layers[0].wqkv is None else [0]:
        check_prompt_and_decodes(step, w, empty_cache(cfg), gold, i)


def test_batched_chunked_prefill_matches_hf(model):
    cfg, w, gold, step = model
    check_batched_chunked_prefill(step, w, empty_cache(cfg), gold)


def sharded_model(src, n: int, ep: bool, ops: str | ModelOps, kv_dtype=None):
    """A checkpoint's weights sharded over n fake devices (experts split with ep) and its jitted step under
    shard_map (`ops`: an OPS key or the ops): (cfg, mesh, weights, step, a function making a fresh KV cache, of
    `kv_dtype` if given)."""
    from jinfer.cache.layout import init_kv_cache
    from jinfer.models.registry import shard_weights
    from jinfer.parallel.mesh import array_specs, check_parallel, make_mesh, mesh_forward

    cfg = src.config
    check_parallel(cfg, n, ep)
    mesh = make_mesh(n)
    w = shard_weights(cfg, load_weights(src, "float32", mesh, progress=False, expert_parallel=ep), mesh,
                      expert_parallel=ep)
    new_kv = partial(init_kv_cache, cfg, NUM_PAGES, PAGE, "float32", mesh, kv_dtype=kv_dtype)
    ops = OPS[ops] if isinstance(ops, str) else ops
    step = jax.jit(mesh_forward(forward, cfg, ops, mesh, array_specs(w), array_specs(new_kv())),
                   donate_argnums=(2,))
    return cfg, mesh, w, step, new_kv


def check_prompt_and_decodes(step, w, kv, gold, i):
    """Prompt i's prefill logits, then 32 greedy decode steps: every step's logits and token as HF's."""
    prompt, greedy = gold[f"prompt_{i}"].tolist(), gold[f"greedy_{i}"].tolist()
    pages = scrambled_pages(i, (len(prompt) + len(greedy)) // PAGE + 1)
    logits, kv = step(w, prefill_batch([(prompt, 0, pages)]), placed_as_outputs(kv, w))
    logits = logits[:len(prompt)]
    np.testing.assert_allclose(np.asarray(logits), gold[f"prefill_logits_{i}"], atol=ATOL, rtol=1e-4)
    # decode_logits[s] are the logits that chose greedy[s] (row 0 = the prompt's last position).
    # Decode with our own greedy tokens: they must equal HF's, and every step's logits must match.
    np.testing.assert_allclose(np.asarray(logits[-1]), gold[f"decode_logits_{i}"][0], atol=ATOL, rtol=1e-4)
    ours = [int(np.argmax(logits[-1]))]
    for s in range(1, len(greedy)):
        logits, kv = step(w, decode_batch(ours[-1], len(prompt) + s - 1, pages), kv)
        np.testing.assert_allclose(np.asarray(logits[0]), gold[f"decode_logits_{i}"][s], atol=ATOL, rtol=1e-4,
                                   err_msg=f"decode step {s}")
        ours.append(int(np.argmax(logits[0])))
    assert ours == greedy


def check_batched_chunked_prefill(step, w, kv, gold):
    """All three prompts in one flattened batch, the longest split into chunks across two steps."""
    prompts = [gold[f"prompt_{i}"].tolist() for i in range(3)]
    perm = scrambled_pages(7, 30)  # disjoint, non-contiguous page sets
    pages = [perm[0:8], perm[8:16], perm[16:30]]
    cut = 13
    kv = placed_as_outputs(kv, w)
    logits1, kv = step(w, prefill_batch([(prompts[0], 0, pages[0]), (prompts[2][:cut], 0, pages[2])]), kv)
    logits2, kv = step(w, prefill_batch([(prompts[1], 0, pages[1]), (prompts[2][cut:], cut, pages[2])]), kv)
    n0, n1 = len(prompts[0]), len(prompts[1])
    np.testing.assert_allclose(np.asarray(logits1[:n0]), gold["prefill_logits_0"], atol=ATOL, rtol=1e-4)
    got2 = np.concatenate([np.asarray(logits1[n0:n0 + cut]), np.asarray(logits2[n1:n1 + len(prompts[2]) - cut])])
    np.testing.assert_allclose(got2, gold["prefill_logits_2"], atol=ATOL, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits2[:n1]), gold["prefill_logits_1"], atol=ATOL, rtol=1e-4)


# An FP8 KV cache (e4m3: 3 mantissa bits, scale 1.0) in these random-weight models moves the logits (magnitude ~3) by
# up to 0.25 from HF's float32 ones (K and V ~0.6 on average); tiny Qwen3's greedy margins stay above that.
FP8_ATOL = 0.3


@pytest.mark.parametrize("ops", ["ref", pytest.param("pallas", marks=pytest.mark.slow)])
def test_fp8_kv_cache_greedy_matches_hf(ops):
    """Tiny Qwen3 with kv_cache_dtype='fp8' (layout.init_kv_cache: e4m3 pages and scales): each prompt (5, 19, 37
    tokens) as `check_fp8_prompt` checks it. With the Pallas kernels (interpreted: the K/V-writing front ends and the
    decode kernel quantize and dequantize) the first prompt."""
    from jinfer.cache.layout import init_kv_cache
    from jinfer.parallel.mesh import make_mesh

    cfg, w, gold, step = make_step("qwen3", ops)
    for i in range(3) if ops == "ref" else [0]:
        kv = init_kv_cache(cfg, NUM_PAGES, PAGE, jnp.float32, make_mesh(1), kv_dtype=jnp.float8_e4m3fn)
        kv = check_fp8_prompt(step, w, kv, gold, i)
        assert kv[0][0].dtype == jnp.float8_e4m3fn and kv[0][2].dtype == jnp.float32


def check_fp8_prompt(step, w, kv, gold, i):
    """Prompt i's prefill logits and its 31 decodes' (HF's own tokens fed back) within FP8_ATOL of HF's, and every
    greedy token HF's. Returns the cache."""
    prompt, greedy = gold[f"prompt_{i}"].tolist(), gold[f"greedy_{i}"].tolist()
    pages = scrambled_pages(i, (len(prompt) + len(greedy)) // PAGE + 1)
    logits, kv = step(w, prefill_batch([(prompt, 0, pages)]), kv)
    np.testing.assert_allclose(np.asarray(logits[:len(prompt)]), gold[f"prefill_logits_{i}"], atol=FP8_ATOL)
    ours = [int(np.argmax(logits[len(prompt) - 1]))]
    for s in range(1, len(greedy)):
        logits, kv = step(w, decode_batch(greedy[s - 1], len(prompt) + s - 1, pages), kv)
        np.testing.assert_allclose(np.asarray(logits[0]), gold[f"decode_logits_{i}"][s], atol=FP8_ATOL,
                                   err_msg=f"decode step {s}")
        ours.append(int(np.argmax(logits[0])))
    assert ours == greedy, f"prompt {i}"
    return kv
