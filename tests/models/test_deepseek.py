"""Tiny random-weight DeepSeek-V2 and DeepSeek-V3 checkpoints (tests/data/tiny-deepseek_v2, tiny-deepseek_v3, made
by HF transformers in scripts/make_golden.py) against HF's logits and greedy ids: multi-head latent attention over
the latent paged cache (absorbed form), YaRN (V2), q low rank and interleaved RoPE (V3), a dense first layer then
DeepSeekMoE (V2: softmax, group-limited; V3: sigmoid + correction bias, top groups, renormalised and scaled; shared
experts). One device and tp / ep = 2 on fake CPU devices, the forward alone and the whole engine (chunked prefill,
prefix-cache hits), and the cache's size: one latent row per token per layer. The same checkpoints as `deepseek2`
GGUF files (tests/data/tiny-deepseek_v*.gguf, scripts/make_deepseek_gguf.py: llama.cpp's converter; V2's with
`attn_kv_b` whole, V3's split into `attn_k_b` / `attn_v_b`) give HF's logits and ids too. tiny-deepseek_v2_lite:
V2-Lite's greedy softmax routing, on the Pallas ops' MoE front-end kernel."""

import dataclasses
import math
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jinfer.cache.layout import init_kv_cache, kv_cache_bytes_per_page
from jinfer.cache.spec import LatentKV
from jinfer.config.kernels import KernelPolicy
from jinfer.config.model import NAMED_SHAPES, ModelConfig
from jinfer.config.rope import yarn_attention_factor, yarn_softmax_mscale
from jinfer.llm import LLM
from jinfer.models.batch import make_batch
from jinfer.models.registry import cache_spec, forward, weight_specs
from jinfer.parallel.mesh import check_parallel, make_mesh
from jinfer.sampling_params import SamplingParams
from jinfer.weights.gguf import GGUFTensorSource
from jinfer.weights.gguf_meta import read_metadata
from jinfer.weights.loader import load_weights, resolve_model

from ..conftest import DATA
from .test_golden_tiny import (
    OPS,
    check_batched_chunked_prefill,
    check_prompt_and_decodes,
    decode_batch,
    prefill_batch,
    scrambled_pages,
    sharded_model,
)

ARCHS = ("deepseek_v2", "deepseek_v3")
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def gold(arch):
    return np.load(DATA / "golden" / f"tiny-{arch}.npz")


# Each family on one device; tensor parallel on V2, expert parallel (heads split too) on V3, 2 and 4 ways (V3 at 4: two
# experts a device); each from GGUF on one;
# the Pallas kernels on V2 on one device and on V3 expert parallel (each device its experts' blocks: local_experts).
CASES = [("deepseek_v2", 1, False, "ref"), ("deepseek_v3", 1, False, "ref"), ("deepseek_v2", 2, False, "ref"),
         ("deepseek_v3", 2, True, "ref"), ("deepseek_v2", 4, False, "ref"), ("deepseek_v3", 4, True, "ref"),
         pytest.param(("deepseek_v2", 1, False, "pallas"), marks=pytest.mark.slow),
         pytest.param(("deepseek_v3", 2, True, "pallas"), marks=pytest.mark.slow),
         ("deepseek_v2", 1, False, "ref", ".gguf"), ("deepseek_v3", 1, False, "ref", ".gguf")]


# The Pallas ops (interpreted) with sequences of >= 8 new tokens in the MLA kernels' expanded form (the default's 64
# is more than these prompts): the batched chunked prefill's steps hold a 5-token prompt (absorbed), a 19-token prompt
# and a first 13-token chunk (expanded), and a 24-token chunk after 13 cached tokens (expanded, its context absorbed,
# merged).
PALLAS = dataclasses.replace(OPS["pallas"], policy=KernelPolicy(mla_expand_min_query_len=8))


@pytest.fixture(scope="module", params=CASES,
                ids=lambda p: f"{p[0]}-{'ep' if p[2] else 'tp'}{p[1]}-{p[3]}" + ("-gguf" if p[4:] else ""))
def model(request):
    """The Pallas ops (interpreted) run the dense layer's and the projections' kernels, the routed experts' grouped
    GEMMs (the routing in XLA; on one device the shared experts stacked with the routed ones, else on the fused SwiGLU
    kernel) and the MLA decode kernel in one-token
    steps, and the ragged MLA kernels in the others (PALLAS); the reference ops the jnp MLA reference."""
    arch, n, ep, ops, *suffix = request.param
    src = resolve_model(DATA / f"tiny-{arch}{''.join(suffix)}")
    assert src.kind == ("gguf" if suffix else "hf")
    cfg, _, w, step, new_kv = sharded_model(src, n, ep, PALLAS if ops == "pallas" else ops)
    return cfg, w, gold(arch), step, new_kv


def split(a, axis):
    return a.shape[axis] // a.sharding.shard_shape(a.shape)[axis]


def test_heads_split_latent_replicated(model):
    """Sharded: q, the latent's up-projection and o split by head, the latent projection and cache whole."""
    cfg, w, _, _, empty = model
    n, layer, moe = w.embed.sharding.mesh.size, w.layers[0], w.layers[1]
    q = layer.wq if layer.wq is not None else layer.wq_b
    assert split(q, 1) == n and split(layer.wkv_b, 1) == n and split(layer.wo, 0) == n
    assert split(layer.wkv_a, 1) == 1
    if moe.ws_gate is None:  # one device or tensor parallel: the shared experts stacked after the routed ones
        assert moe.w_gate.shape[0] == cfg.num_experts + cfg.num_shared_experts and split(moe.w_gate, 2) == n
    else:  # expert parallel: the shared experts apart, split by columns
        assert n > 1 and split(moe.w_gate, 0) == n and split(moe.ws_gate, 1) == n
    assert all(split(a, 2) == 1 and a.shape[2] == cfg.latent_dim for (a,) in empty())


def test_config_read_from_hf():
    v2, v3 = (resolve_model(DATA / f"tiny-{a}").config for a in ARCHS)
    for cfg in (v2, v3):
        assert (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (32, 16, 8, 16)
        assert cfg.head_dim == 24 and cfg.rotary_dim == 8 and cfg.latent_dim == 40 and cfg.rope_interleave
        assert cfg.mlp_only_layers == (0,) and [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (8, 2, 4, 2)
    assert v2.q_lora_rank == 0 and v2.scoring_func == "softmax" and v2.num_shared_experts == 2
    assert v2.rope_scaling.rope_type == "yarn" and not v2.norm_topk_prob and v2.routed_scaling_factor == 1.5
    assert v3.q_lora_rank == 24 and v3.scoring_func == "sigmoid" and v3.num_shared_experts == 1
    assert v3.norm_topk_prob and v3.routed_scaling_factor == 2.5


def test_config_read_from_gguf():
    """The GGUF files' configs are the HF directories' but for what GGUF keeps in float32 (rms_norm_eps) and V2's
    YaRN mscales: GGUF has mscale_all_dim only (mscale is taken equal to it) and the attention factor transformers
    derives from the two, stated in the file (see scripts/make_deepseek_gguf.py)."""
    for arch in ARCHS:
        hf, gg = (resolve_model(DATA / f"tiny-{arch}{s}").config for s in ("", ".gguf"))
        assert gg.rms_norm_eps == pytest.approx(hf.rms_norm_eps)
        rs = gg.rope_scaling
        if arch == "deepseek_v2":
            assert rs.mscale == rs.mscale_all_dim == pytest.approx(0.8)
            assert yarn_attention_factor(rs) == pytest.approx(yarn_attention_factor(hf.rope_scaling))
            assert yarn_softmax_mscale(rs) == pytest.approx(yarn_softmax_mscale(hf.rope_scaling))
            rs = hf.rope_scaling
        assert gg.replace(rms_norm_eps=hf.rms_norm_eps, rope_scaling=rs) == hf


@pytest.mark.parametrize("drop,match", [
    ("deepseek2.attention.kv_lora_rank", "'deepseek2.attention.kv_lora_rank' is missing"),
    ("deepseek2.rope.dimension_count", "'deepseek2.rope.dimension_count' is missing"),
])
def test_gguf_config_errors_name_the_key(drop, match):
    meta = read_metadata(DATA / "tiny-deepseek_v3.gguf")
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_gguf_metadata({k: v for k, v in meta.items() if k != drop})
    with pytest.raises(ValueError, match="expert_gating_func'=3"):
        ModelConfig.from_gguf_metadata(meta | {"deepseek2.expert_gating_func": 3})


def test_gguf_split_kv_b_missing_names_the_tensor(monkeypatch):
    src = resolve_model(DATA / "tiny-deepseek_v3.gguf")
    reader = GGUFTensorSource(src.path, src.config)
    monkeypatch.delitem(reader._tensors, "blk.2.attn_v_b.weight")
    with pytest.raises(ValueError, match="'blk.2.attn_kv_b.weight' is missing .* 'blk.2.attn_v_b.weight'"):
        reader.get(weight_specs(src.config)["layers.2.wkv_b"])


# the published config.json files (the fields jinfer reads, and a few it ignores)
PUBLISHED = {
    "deepseek-v2-lite": dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                             num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
                             routed_scaling_factor=1.0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                             v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy", n_group=1, topk_group=1,
                             num_experts_per_tok=6, moe_layer_freq=1, first_k_dense_replace=1, norm_topk_prob=False,
                             scoring_func="softmax", aux_loss_alpha=0.001, max_position_embeddings=163840,
                             rms_norm_eps=1e-6, rope_theta=10000,
                             rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=0.707, mscale_all_dim=0.707,
                                               original_max_position_embeddings=4096, type="yarn"),
                             bos_token_id=100000, eos_token_id=100001, tie_word_embeddings=False),
    "deepseek-v3": dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
                        intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                        num_nextn_predict_layers=1, num_attention_heads=128, num_key_value_heads=128,
                        n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                        q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
                        topk_method="noaux_tc", n_group=8, topk_group=4, num_experts_per_tok=8, moe_layer_freq=1,
                        first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
                        max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000,
                        rope_scaling=dict(beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
                                          original_max_position_embeddings=4096, type="yarn"),
                        bos_token_id=0, eos_token_id=1, tie_word_embeddings=False),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_config_is_the_named_shape(name):
    assert ModelConfig.from_hf_config(PUBLISHED[name]) == NAMED_SHAPES[name]


@pytest.mark.parametrize("kw,match", [
    ({"kv_lora_rank": 0}, "kv_lora_rank=0"),
    ({"head_dim": 128}, "head_dim=128"),
    ({"scoring_func": "softplus"}, "scoring_func"),
    ({"topk_group": 9}, "topk_group=9"),
    ({"n_group": 3}, "n_group"),
    ({"architecture": "qwen3_moe"}, "kv_lora_rank=512"),
])
def test_config_checks(kw, match):
    with pytest.raises(ValueError, match=match):
        NAMED_SHAPES["deepseek-v3"].replace(**kw)


def test_parallel_checks():
    cfg = NAMED_SHAPES["deepseek-v2-lite"]
    check_parallel(cfg, 8, expert_parallel=True)
    with pytest.raises(ValueError, match="shared experts"):
        check_parallel(cfg.replace(num_shared_experts=1, moe_intermediate_size=1407), 2, expert_parallel=True)


@pytest.mark.parametrize("i", [0, 1, 2])
def test_prefill_and_every_decode_step_match_hf(model, i):
    cfg, w, g, step, empty = model
    check_prompt_and_decodes(step, w, empty(), g, i)


def test_batched_chunked_prefill_matches_hf(model):
    cfg, w, g, step, empty = model
    check_batched_chunked_prefill(step, w, empty(), g)


@pytest.mark.parametrize("arch", ARCHS)
def test_pallas_ops_run_the_kernels(arch):
    """The Pallas cases above go through the expert kernels, not the reference's ragged dots, with the shared experts
    stacked after the routed ones (one device: no shared MLP), a one-token step's dense MLP through the fused SwiGLU
    kernel, and their prefill steps (the batched chunked prefill's second) through the ragged MLA kernels in both
    forms, not the jnp reference attention (traced only)."""
    cfg, _, w, step, empty = sharded_model(resolve_model(DATA / f"tiny-{arch}"), 1, False, PALLAS)
    moe = [layer for i, layer in enumerate(w.layers) if cfg.is_moe_layer(i)]
    assert moe and all(layer.w_gate.shape[0] == cfg.num_experts + cfg.num_shared_experts for layer in moe)
    jaxpr = str(jax.make_jaxpr(step)(w, decode_batch(1, 20, scrambled_pages(0, 8)), empty()))
    assert all(k in jaxpr for k in ("moe_route_chosen", "moe_gate_up", "moe_down")) and "ragged_dot" not in jaxpr
    assert len(re.findall(r"name=fused_swiglu_mlp\b", jaxpr)) == cfg.num_layers - len(moe)
    assert "mla_decode_attention" in jaxpr
    g, pages = gold(arch), scrambled_pages(7, 30)
    prompts = [g[f"prompt_{i}"].tolist() for i in range(3)]
    prefill = prefill_batch([(prompts[1], 0, pages[8:16]), (prompts[2][13:], 13, pages[16:30]),
                             (prompts[0], 0, pages[:8])])
    jaxpr = str(jax.make_jaxpr(step)(w, prefill, empty()))
    assert "mla_absorbed_attention" in jaxpr and "mla_expanded_attention" in jaxpr
    assert "ragged_prefill_attention_reference" not in jaxpr


@pytest.mark.parametrize("n,ep", [(1, False), (2, True)], ids=["tp1", "ep2"])
def test_v2_lite_routing_on_the_front_kernel_matches_hf(n, ep):
    """DeepSeek-V2-Lite's routing (`topk_method: greedy`: softmax top-k over all experts, scaled, not renormalised)
    on the Pallas ops (interpreted): small steps route on the one-kernel MoE front end with float32 logits (the
    5-token prefill and every one-token decode step), and prompt and decode logits and greedy ids equal HF's, on one
    device and expert parallel on two (each device its experts of the front end's routing)."""
    src = resolve_model(DATA / "tiny-deepseek_v2_lite")
    assert (src.config.n_group, src.config.topk_group, src.config.routed_scaling_factor) == (1, 1, 1.5)
    _, _, w, step, empty = sharded_model(src, n, ep, PALLAS)
    assert "moe_norm_route" in str(jax.make_jaxpr(step)(w, decode_batch(1, 20, scrambled_pages(0, 8)), empty()))
    g = gold("deepseek_v2_lite")
    for i in range(3):
        check_prompt_and_decodes(step, w, empty(), g, i)


def test_latent_cache_size():
    """One row of kv_lora_rank + qk_rope_head_dim values per token and layer, on every device (not split by heads):
    576 for DeepSeek-V2-Lite / V3, against Qwen3-30B-A3B's 2 x 4 kv heads x 128."""
    for name, layers in (("deepseek-v2-lite", 27), ("deepseek-v3", 61)):
        cfg = NAMED_SHAPES[name]
        assert cache_spec(cfg) == [LatentKV(576)] * layers
        for tp in (1, 2, 8):
            assert kv_cache_bytes_per_page(cfg, 16, "bfloat16", tp) == 16 * 576 * layers * 2
    qwen = NAMED_SHAPES["qwen3-30b-a3b"]
    assert kv_cache_bytes_per_page(qwen, 16, "bfloat16") == 16 * 2 * 4 * 128 * 48 * 2
    v3 = NAMED_SHAPES["deepseek-v3"]
    assert 660e9 < v3.num_params() < 680e9 and 36e9 < v3.num_params(active=True) < 39e9
    for name in ("deepseek-v2-lite", "deepseek-v3"):  # the weight specs hold what num_params counts
        cfg = NAMED_SHAPES[name]
        assert sum(math.prod(s.shape) for s in weight_specs(cfg).values()) == cfg.num_params()


@pytest.mark.parametrize("shape", ["deepseek-v3"])  # (V2-Lite's shape differs only in sizes checked above)
def test_dummy_shape_runs_in_bfloat16(shape):
    """The named shapes with few and narrow layers (head dims, latent and routing as published), random bfloat16
    weights: a prefill gives finite logits; V3's routing bias stays float32 (as HF keeps it)."""
    src = resolve_model(f"dummy:{shape},num_layers=4,hidden_size=64,intermediate_size=64,moe_intermediate_size=32,"
                        "num_heads=2,num_kv_heads=2,num_experts=16,vocab_size=256")
    cfg = src.config
    w = load_weights(src, "bfloat16", progress=False)
    assert (cfg.latent_dim, cfg.head_dim) == (576, 192) and w.layers[-1].w_gate.dtype == jnp.bfloat16
    if cfg.scoring_func == "sigmoid":
        assert w.layers[-1].router_bias.dtype == jnp.float32
    mesh = make_mesh(1)
    kv = init_kv_cache(cfg, 8, 4, jnp.bfloat16, mesh)
    batch = make_batch([(list(range(1, 12)), 0, [1, 2, 3])], 4, num_tokens=16, num_seqs=2, pages_per_seq=4)
    logits, kv, aux = jax.jit(partial(forward, cfg=cfg, aux_layers=(0, 2, 4)))(w, batch, kv)  # (EAGLE-3's inputs)
    assert logits.shape[1] == 256 and bool(jnp.isfinite(logits[0]).all()) and aux.shape == (16, 3 * 64)
    assert kv[0][0].shape == (8, 4, 576) and kv[0][0].dtype == jnp.bfloat16


@pytest.mark.slow
def test_engine_greedy_matches_hf(monkeypatch):
    """The whole engine: 16-token steps (the 37-token prompt prefilled in chunks beside the others' decodes), the
    same prompts again from the prefix cache; the pool's bytes are one latent row per token and layer. With 29
    usable pages (the three sequences need 41) requests are preempted and recomputed. (V3 only: the engine runs
    either family's latent cache alike, and V2's forward is checked against HF above, on the engine's step shapes
    too (the batched chunked prefill); tensor parallel: the step tests.)"""
    arch = "deepseek_v3"
    g = gold(arch)
    prompts, greedy = [g[f"prompt_{i}"].tolist() for i in range(3)], [g[f"greedy_{i}"].tolist() for i in range(3)]
    llm = LLM(str(DATA / f"tiny-{arch}"), dtype="float32", page_size=4, max_model_len=128, max_num_batched_tokens=16,
              max_num_seqs=8, compilation_cache_dir="", num_pages=30, warmup=False)
    core = llm.engine
    preempted = []
    real = core.scheduler._preempt
    monkeypatch.setattr(core.scheduler, "_preempt", lambda r: preempted.append(r.request_id) or real(r))
    cfg = resolve_model(DATA / f"tiny-{arch}").config
    layers = core.runner.kv_cache
    assert len(layers) == cfg.num_layers and all(len(layer) == 1 for layer in layers)
    num_pages = layers[0][0].shape[0]
    assert sum(a.nbytes for layer in layers for a in layer) == num_pages * 4 * cfg.latent_dim * cfg.num_layers * 4
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == greedy
    hits = core.kv.num_hit_tokens
    again = llm.generate([{"prompt_token_ids": p} for p in prompts[::-1]], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in again] == greedy[::-1]
    assert core.kv.num_hit_tokens > hits and core.kv.num_free_pages == core.kv.num_usable_pages
    assert preempted


@pytest.mark.slow
def test_host_tier_brings_latent_pages_back():
    """A 29-page HBM pool with the host tier, the prompts one at a time: the prompts again, each after the others
    evicted its pages, come back from host memory (latent rows, one array per layer) with HF's ids. (The engine's
    shapes are test_engine_greedy_matches_hf's: its executables come from the run's cache.)"""
    g = gold("deepseek_v3")
    prompts, greedy = [g[f"prompt_{i}"].tolist() for i in range(3)], [g[f"greedy_{i}"].tolist() for i in range(3)]
    cfg = resolve_model(DATA / "tiny-deepseek_v3").config
    page_bytes = kv_cache_bytes_per_page(cfg, 4, "float32")
    llm = LLM(str(DATA / "tiny-deepseek_v3"), dtype="float32", page_size=4, max_model_len=128, num_pages=30,
              max_num_batched_tokens=16, max_num_seqs=8, compilation_cache_dir="", warmup=False,
              kv_offload_gb=64 * page_bytes / 2**30)
    core = llm.engine
    assert core.runner.host_pool.page_bytes == page_bytes == 4 * cfg.latent_dim * cfg.num_layers * 4
    for _ in range(2):
        for p, ids in zip(prompts, greedy, strict=True):
            out = llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)
            assert list(out[0].outputs[0].token_ids) == ids
    assert core.kv.num_host_hit_tokens > 0 and core.kv.num_free_pages == core.kv.num_usable_pages
