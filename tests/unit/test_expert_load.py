"""The expert-load recorder (--expert-load-stats): the device's counts against routers computed independently in
numpy (each MoE block path: XLA reference, routing kernel, fused front end, DeepSeek's grouped top-k), padding rows
excluded; the forward with the flag off is the plain program (the flag on adds only the counting); the host side's
imbalance, stats, stats line and /metrics. The whole engine (ep = 2 on fake devices):
tests/models/test_expert_load_engine.py."""

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import partial_eval as pe

from jinfer.cache.layout import init_kv_cache
from jinfer.config.engine import EngineConfig
from jinfer.engine.args import add_engine_arguments, engine_config_kwargs
from jinfer.engine.expert_load import ExpertLoadRecorder, imbalance, summarize
from jinfer.engine.stats_log import StatsLogger
from jinfer.models.batch import make_batch
from jinfer.models.registry import forward, moe_layers
from jinfer.ops import ModelOps
from jinfer.parallel.mesh import make_mesh
from jinfer.weights.loader import load_weights, resolve_model
from server.metrics import Metrics

from ..conftest import DATA

PALLAS = ModelOps("pallas", interpret=True)


def softmax_topk_ids(x, norm, router, top_k, eps=1e-6):
    """numpy: HF's RMSNorm, router, softmax, top-k (ties to the lower id) -> ids [T, k]."""
    x = np.asarray(x, np.float64)
    h = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(norm)
    logits = h @ np.asarray(router, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return np.argsort(-p / p.sum(-1, keepdims=True), axis=-1, kind="stable")[:, :top_k]


def counts_of(ids, num_real, experts):
    return np.bincount(np.asarray(ids)[:num_real].ravel(), minlength=experts)


def block_inputs(tokens, hidden=64, experts=16, inter=32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 6)
    w = lambda k, s: jax.random.normal(k, s) * hidden**-0.5  # noqa: E731
    x = jax.random.normal(ks[0], (tokens, hidden))
    return (x, 1 + 0.1 * jax.random.normal(ks[1], (hidden,)), w(ks[2], (hidden, experts)) * 4,
            w(ks[3], (experts, hidden, inter)), w(ks[4], (experts, hidden, inter)), w(ks[5], (experts, inter, hidden)))


@pytest.mark.parametrize("ops,tokens,counters", [
    (ModelOps(), 24, False),  # XLA: layers.moe_mlp's routing
    (PALLAS, 24, False),  # the routing kernel (moe_route) and the grouped GEMMs
    (PALLAS, 6, True),  # the fused norm + router + routing kernel (moe_norm_route) of small steps
], ids=["reference", "route-kernel", "front-kernel"])
def test_moe_block_counts_match_numpy_router(ops, tokens, counters):
    x, norm, router, wg, wu, wd = block_inputs(tokens)
    num_real = tokens - 5  # the last 5 rows are padding: routed, not counted
    kw = dict(top_k=4, renormalize=True, eps=1e-6)

    @jax.jit
    def both(x, n):  # (with and without counting: the block's output is the same)
        c = ops.step_counters(tokens) if counters else None
        return ops.moe_block(x, norm, router, wg, wu, wd, **kw, counters=c, num_real=n), \
            ops.moe_block(x, norm, router, wg, wu, wd, **kw, counters=c)[0]

    (out, _, counts), plain = both(x, num_real)
    want = counts_of(softmax_topk_ids(x, norm, router, 4), num_real, 16)
    np.testing.assert_array_equal(np.asarray(counts), want)
    assert counts.dtype == jnp.int32 and int(counts.sum()) == num_real * 4
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))


def test_grouped_moe_block_counts_match_numpy_grouped_topk():
    """DeepSeek-V3's routing: sigmoid scores, the correction bias choosing, the best topk_group of n_group groups
    (a group's score: its best two), then top-k within them."""
    tokens, experts, top_k, n_group, topk_group = 20, 16, 4, 4, 2
    x, norm, router, wg, wu, wd = block_inputs(tokens, experts=experts, seed=1)
    bias = jax.random.normal(jax.random.key(7), (experts,)) * 0.1
    num_real = 13
    block = jax.jit(partial(ModelOps().grouped_moe_block, top_k=top_k, n_group=n_group, topk_group=topk_group,
                            sigmoid=True, renormalize=True, scaling=2.5, eps=1e-6))
    _, _, counts = block(x, norm, router, bias, wg, wu, wd, None, num_real=num_real)
    xf = np.asarray(x, np.float64)
    h = xf / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * np.asarray(norm)
    choice = 1 / (1 + np.exp(-(h @ np.asarray(router, np.float64)))) + np.asarray(bias)  # [T, E]
    groups = choice.reshape(tokens, n_group, -1)
    group_score = np.sort(groups, axis=-1)[..., -2:].sum(-1)  # [T, G]
    best = np.argsort(-group_score, axis=-1, kind="stable")[:, :topk_group]
    allowed = np.zeros((tokens, n_group), bool)
    np.put_along_axis(allowed, best, True, axis=1)
    masked = np.where(np.repeat(allowed, experts // n_group, axis=1), choice, -np.inf)
    ids = np.argsort(-masked, axis=-1, kind="stable")[:, :top_k]
    np.testing.assert_array_equal(np.asarray(counts), counts_of(ids, num_real, experts))


def test_grouped_moe_block_softmax_routing_takes_the_front_kernel(monkeypatch):
    """DeepSeek-V2-Lite's routing (softmax, no groups, no bias) in a small step given the step's counters: the fused
    norm + router + routing kernel with float32 logits (HF's DeepSeek router; a bf16 model's would be rounded
    otherwise), its counts numpy's and its output the XLA path's (which HF's goldens check), the routed scaling factor
    applied."""
    from pallas_kernels.moe import moe_router

    calls = []
    kernel = moe_router.moe_norm_route
    monkeypatch.setattr(moe_router, "moe_norm_route", lambda *a, **k: calls.append(k) or kernel(*a, **k))
    tokens, experts, top_k = 6, 16, 4
    x, norm, router, wg, wu, wd = block_inputs(tokens, experts=experts, seed=2)
    kw = dict(top_k=top_k, n_group=1, topk_group=1, sigmoid=False, renormalize=False, scaling=1.5, eps=1e-6)
    front = partial(PALLAS.grouped_moe_block, **kw, counters=PALLAS.step_counters(tokens), num_real=tokens)
    out, counters, counts = jax.jit(front)(x, norm, router, None, wg, wu, wd, None)
    assert [c["round_logits"] for c in calls] == [False]
    want, _ = jax.jit(partial(ModelOps().grouped_moe_block, **kw))(x, norm, router, None, wg, wu, wd, None)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(counts), counts_of(softmax_topk_ids(x, norm, router, top_k), tokens,
                                                                experts))
    assert not np.asarray(counters).any()


# ---- the forward: off is the plain program; on adds only the counting ------------------------------------------------

def traced(arch, ops, real, num_tokens, expert_load):
    """(cfg, the forward, its arguments, its jaxpr) on a batch of `real` new tokens padded to `num_tokens`."""
    src = resolve_model(DATA / f"tiny-{arch}")
    cfg, mesh = src.config, make_mesh(1)
    weights = load_weights(src, "float32", mesh, progress=False)
    kv = init_kv_cache(cfg, 32, 4, "float32", mesh, num_state_slots=5)
    seqs = [(list(range(3, real)), 0, [1, 2, 3, 4]), ([5, 6], 0, [5]), ([7], 4, [6, 7])]
    batch = make_batch(seqs, 4, num_tokens=num_tokens, num_seqs=4)  # padding rows and a padding sequence
    extra = {"expert_load": True} if expert_load else {}
    fn = partial(forward, cfg=cfg, ops=ops, **extra)
    return cfg, fn, (weights, batch, kv), jax.make_jaxpr(fn)(weights, batch, kv)


@pytest.mark.parametrize("arch,ops,tokens,kernel", [
    ("qwen3_moe", ModelOps(), 16, "ragged_dot"), ("qwen3_moe", PALLAS, 16, "moe_route_t16"),
    ("qwen3_moe", PALLAS, 8, "moe_norm_route"), ("qwen3_5_moe", ModelOps(), 16, "ragged_dot"),
    ("deepseek_v3", ModelOps(), 16, "ragged_dot"), ("deepseek_v2", PALLAS, 16, "moe_route_chosen")],
    ids=["qwen3_moe", "qwen3_moe-route-kernel", "qwen3_moe-front-kernel", "qwen3_5_moe", "deepseek_v3",
         "deepseek_v2-route-chosen-kernel"])
def test_flag_off_is_the_plain_step_and_on_only_adds_the_counts(arch, ops, tokens, kernel):
    """The flag off binds nothing: the forward's jaxpr has the plain outputs. On, it has one more, i32[MoE layers, E],
    and without that output (dead code removed) it is the same program as off, equation for equation: the counting
    reads the routing the block computes anyway and changes nothing else. (Off, the jaxpr is also the one from before
    the recorder existed: checked once by hand, every family and kernel path here.)"""
    cfg, _, _, off = traced(arch, ops, 6, tokens, False)
    _, _, _, on = traced(arch, ops, 6, tokens, True)
    assert len(on.out_avals) == len(off.out_avals) + 1
    assert on.out_avals[-1].shape == (len(moe_layers(cfg)), cfg.num_experts) and on.out_avals[-1].dtype == jnp.int32
    used = [True] * len(off.out_avals)
    pruned, _ = pe.dce_jaxpr(on.jaxpr, used + [False])
    plain, _ = pe.dce_jaxpr(off.jaxpr, used)
    assert str(pruned) == str(plain)
    assert str(on.jaxpr) != str(off.jaxpr) and kernel in str(off.jaxpr)  # (the routing path the case is about)


def test_forward_counts_are_the_real_tokens_routed():
    """qwen3_moe's forward with the flag: per MoE layer the counts sum to real tokens x top_k (8 padding rows routed
    too, not counted), and logits and cache are the plain forward's."""
    cfg, fn, args, _ = traced("qwen3_moe", ModelOps(), 8, 16, True)
    logits, _, counts = jax.jit(fn)(*args)
    real = 8  # 5 + 2 + 1 new tokens
    assert moe_layers(cfg) == (0, 2)  # layer 1 is dense (mlp_only_layers)
    np.testing.assert_array_equal(np.asarray(counts).sum(1), [real * cfg.num_experts_per_tok] * 2)
    plain = partial(forward, cfg=cfg, ops=ModelOps())
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(jax.jit(plain)(*args)[0]))


def test_dense_model_refuses_the_flag():
    src = resolve_model(DATA / "tiny-qwen3")
    with pytest.raises(ValueError, match="expert_load_stats"):
        forward(None, None, None, src.config, expert_load=True)


# ---- host side ------------------------------------------------------------------------------------------------------

def test_imbalance_is_busiest_rank_over_mean_summed_over_layers():
    counts = np.array([[3, 1, 0, 0], [0, 0, 2, 2]])  # layer 0 all on rank 0, layer 1 all on rank 1 (of 2)
    assert imbalance(counts, 2) == 2.0  # (4 + 4) / (2 + 2)
    assert imbalance(counts, 4) == 2.5  # experts: (3 + 2) / (1 + 1)
    assert imbalance(counts, 1) == 1.0
    assert imbalance(np.array([[2, 2, 2, 2]]), 2) == 1.0
    assert imbalance(np.zeros((2, 4), int), 2) == 1.0  # nothing routed: nothing waits


def test_recorder_steps_cumulative_stats_and_summary():
    rec = ExpertLoadRecorder((0, 2), num_experts=8, top_k=2, ranks=2)
    a = np.zeros((2, 8), np.int32)
    a[0, [0, 1, 4]], a[1, [5, 6, 7]] = (2, 1, 3), (1, 4, 1)  # 3 tokens x top-2 per layer
    step = rec.record(a)
    assert step.tokens == 3 and step.rank_tokens == (3, 9)  # rank 0: experts 0-3, rank 1: 4-7
    assert step.imbalance == (3 + 6) * 2 / 12 and step.what_if[8] == step.expert_imbalance
    assert set(step.what_if) == {2, 4, 8}
    b = np.full((2, 8), 1, np.int32)  # 4 tokens, balanced
    rec.record(b)
    np.testing.assert_array_equal(rec.cumulative, a + b)
    stats = rec.stats()
    assert stats["expert_load_steps_total"] == 2 and stats["expert_load_ranks"] == 2
    assert stats["expert_load_imbalance"] == 1.0 and stats["expert_load_imbalance_sum"] == step.imbalance + 1.0
    assert stats["expert_load_rank_tokens_total_0"] == 3 + 8 and stats["expert_load_rank_tokens_total_1"] == 9 + 8
    assert [stats[f"expert_load_expert_tokens_total_{e}"] for e in range(8)] == list((a + b).sum(0))
    assert stats["expert_load_cumulative_imbalance"] == imbalance(a + b, 2)
    s = summarize(list(rec.history))
    assert s["steps"] == 2 and s["imbalance_max"] == step.imbalance and s["tokens_per_step_mean"] == 3.5
    assert s["ep8_imbalance_mean"] == s["expert_imbalance_mean"]
    with pytest.raises(ValueError, match="counts.shape"):
        rec.record(np.zeros((3, 8)))


@pytest.mark.parametrize("kw,field", [(dict(ranks=3), "ranks=3"), (dict(top_k=9), "top_k=9"),
                                      (dict(layers=()), "layers=()"), (dict(num_experts=0), "num_experts=0")])
def test_recorder_names_a_bad_field(kw, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        ExpertLoadRecorder(**(dict(layers=(0,), num_experts=8, top_k=2) | kw))


def test_config_flag_and_cli():
    with pytest.raises(ValueError, match="expert_load_stats='yes'"):
        EngineConfig(expert_load_stats="yes")
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    parser.add_argument("--model")
    assert engine_config_kwargs(parser.parse_args(["--expert-load-stats"]))["expert_load_stats"] is True
    assert "expert_load_stats" not in engine_config_kwargs(parser.parse_args([]))
    assert EngineConfig().expert_load_stats is False


def test_stats_line_and_metrics():
    rec = ExpertLoadRecorder((0,), num_experts=4, top_k=1, ranks=2)
    now = [0.0]
    logger = StatsLogger(10.0, clock=lambda: now[0])
    now[0] = 10.0
    logger.maybe_log({"num_running": 1, **rec.stats()})
    rec.record(np.array([[3, 1, 0, 0]]))  # imbalance 2.0, experts 3.0
    rec.record(np.array([[1, 1, 1, 1]]))  # 1.0 and 1.0
    now[0] = 20.0
    line = logger.maybe_log({"num_running": 1, **rec.stats()})
    # (since start: [4, 2, 1, 1], ranks 6 and 2: 6 / 4)
    assert line.splitlines()[-1] == ("Engine 000: Expert load: 2 steps, imbalance over 2 rank(s) 1.500 (since start "
                                     "1.500), over experts 2.000")
    metrics = Metrics("m")
    metrics.set_engine_stats(rec.stats(), True)
    text = metrics.render().decode()
    for sample in ('jinfer_expert_load_steps_total{replica="0"} 2.0', 'jinfer_expert_load_imbalance_total{replica="0"} '
                   '3.0', 'jinfer_expert_load_last_imbalance{replica="0"} 1.0',
                   'jinfer_expert_load_rank_tokens_total{rank="1",replica="0"} 2.0',
                   'jinfer_expert_load_expert_tokens_total{expert="0",replica="0"} 4.0'):
        assert sample in text, sample
    assert "expert_load" not in Metrics("m").render().decode()  # an engine without the flag: no series
