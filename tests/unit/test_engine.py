"""EngineCore + LLM on a tiny Llama (tests/data/tiny-llama): batching, preemption, chunking and
prefix caching must be invisible in the outputs; nothing compiles after warm-up."""

import contextlib
import gc
import logging
import sys
import time
import weakref

import jax
import numpy as np
import pytest

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.engine.idle_unload import RELOAD_AFTER_STEPS
from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA

TINY = str(DATA / "tiny-llama")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BASE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=16,
            warmup=False, compilation_cache_dir="")


def prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(3, 40))).tolist() for _ in range(n)]


def run_all(core: EngineCore, reqs, arrivals=None, max_steps=10_000):
    """Feed (id, prompt, params) into the core, request i at step arrivals[i]; return id -> token ids."""
    arrivals = arrivals or [0] * len(reqs)
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    step = 0
    pending = sorted(zip(arrivals, range(len(reqs))))
    while pending or core.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            rid, prompt, params = reqs[pending.pop(0)[1]]
            core.add_request(rid, prompt, params)
        for d in core.step():
            out.setdefault(f"{d.request_id}/{d.index}", []).extend(d.new_token_ids)
            if d.finished:
                finish[f"{d.request_id}/{d.index}"] = d.finish_reason
        step += 1
        assert step < max_steps
    return out, finish


@pytest.fixture(scope="module")
def alone():
    """Each of 16 prompts generated on its own in a fresh engine, one step at a time: the reference."""
    core = EngineCore(EngineConfig(TINY, **BASE, async_scheduling=False))
    ref = {}
    for i, p in enumerate(prompts(16)):
        out, _ = run_all(core, [(str(i), p, GREEDY)])
        ref[f"{i}/0"] = out[f"{i}/0"]
    return ref


def test_continuous_batching_is_invisible(alone):
    core = EngineCore(EngineConfig(TINY, **BASE))
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(16))]
    together, finish = run_all(core, reqs)
    assert together == alone and set(finish.values()) == {"length"}
    staggered, _ = run_all(core, [(f"{r}", p, s) for r, p, s in reqs], arrivals=[i * 3 for i in range(16)])
    assert staggered == alone
    assert core.kv.num_free_pages == core.kv.num_usable_pages


def test_pallas_decode_steps_match_reference(alone):
    """Pallas kernels (interpreted on CPU): decode-only steps take their own executable (paged decode
    kernel), mixed steps the ragged kernel; the tokens equal the jnp reference engine's."""
    # (16-token steps: two token buckets to compile with the kernels; the longer prompts are prefilled in chunks)
    core = EngineCore(EngineConfig(TINY, **{**BASE, "max_num_seqs": 8, "max_num_batched_tokens": 16, "warmup": True},
                                   attention_backend="pallas"))
    runner = core.runner
    assert runner.ops.backend == "pallas" and runner.decode_buckets == {8}
    steps, picked = [], []  # per launch: every sequence one new token? / the decode-only executable?
    launch, forward_executable = runner.launch, runner.forward_executable
    runner.launch = lambda out, *a, **kw: (steps.append(out.num_scheduled_tokens == len(out.scheduled)),
                                           launch(out, *a, **kw))[1]
    runner.forward_executable = lambda *a: (picked.append(a[3]), forward_executable(*a))[1]
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(6))]
    out, _ = run_all(core, reqs, arrivals=[0, 0, 0, 2, 4, 6])
    assert out == {k: alone[k] for k in out} and len(out) == 6
    assert picked == steps and any(steps) and not all(steps)
    stats = core.stats()
    assert stats["compiles_after_warmup"] == 0
    assert stats["steps_total"] == len(steps) and stats["device_wait_seconds_total"] >= 0  # every launch read back


def test_staged_warmup_then_idle_buckets_unload_and_load_again_on_demand(alone, tmp_path, caplog):
    """A staged warm-up compiles the first bucket only; until the background compiles the rest, steps stay
    within it (padded into it, the scheduler's budget capped) and the tokens are unchanged; once the rest
    is ready larger steps use it, with no compile on the step path.

    Then, with a keep-alive, a bucket beyond the staged warm-up's first one that no step used for that long is dropped
    (its executables released); steps meanwhile run within the loaded buckets with the same tokens, and a step that
    wants the dropped bucket has it loaded again from the executable cache in the background (not compiled). Warm
    starts from that cache, staged and full, end it. (One engine for both parts: its buckets compile once.)"""
    kw = {**BASE, "max_num_batched_tokens": 16, "executable_keep_alive": 30.0, "compilation_cache_dir": str(tmp_path)}
    core = EngineCore(EngineConfig(TINY, **kw))  # buckets 8, 16
    runner = core.runner
    traced = weakref.ref(runner._forward[False][0])
    runner.warmup(first_tokens=8, background=False)
    assert runner.ready_tokens == (8,) and runner.ready_limits() == (8, 8)
    assert core.stats()["warmup_pending"] == len(runner.token_buckets) - 1 + len(runner.decode_buckets)
    sizes = []
    build = runner.build_batch
    runner.build_batch = lambda out, prev=None: (sizes.append(len(out.scheduled)), build(out, prev))[1]
    widths = []
    schedule = core.scheduler.schedule
    core.scheduler.schedule = lambda *a, **kw: (lambda o: (widths.append(o.num_scheduled_tokens), o)[1])(
        schedule(*a, **kw))
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(16))]
    out, _ = run_all(core, reqs)
    assert out == alone
    assert max(widths) == 8 and max(sizes) <= 8
    runner.start_background()
    assert runner.wait_warmup(timeout=300)
    assert runner.ready_tokens == runner.token_buckets == (8, 16) and core.stats()["warmup_pending"] == 0
    gc.collect()  # the compiles done (all stored on disk), the jits that traced them are gone, with their traces
    assert traced() is None and runner.executables.misses > 0
    widths.clear()
    out, _ = run_all(core, [(f"a{r}", p, s) for r, p, s in reqs])
    assert {k[1:]: v for k, v in out.items()} == alone
    assert max(widths) > 8
    assert core.stats()["compiles_after_warmup"] == 0
    assert core.unload_idle() == 0  # all used just now
    dropped = [c._executable.xla_executable for k, c in runner._compiled.items() if k[1] == 16]
    assert runner.unload_idle(now=time.monotonic() + 31) == 0  # 16 is kept too: steps used it last (keep_recent)
    runner.keep_recent = 0  # (the rest of the test unloads it and loads it again)
    assert runner.unload_idle(now=time.monotonic() + 31) == 1  # 16; 8 is the warm-up's first bucket: kept
    assert runner.ready_tokens == (8,) and runner.ready_limits() == (8, 8)
    assert not any(k[1] == 16 for k in runner._compiled if k[0].startswith("forward"))
    assert not any(k[1] == 16 for k in runner._compiled if k[0] == "sample")  # the samplers of 16 sequences too
    gc.collect()  # nothing (the engine, JAX's caches) holds the dropped executables: their memory is freed
    assert dropped and [sys.getrefcount(dropped[i]) for i in range(len(dropped))] == [2] * len(dropped)
    del dropped
    stats = core.stats()
    assert stats["executable_unloads_total"] == 1 and stats["warmup_pending"] == 0
    hits, misses = runner.executables.hits, runner.executables.misses
    i = max(range(16), key=lambda i: len(prompts(16)[i]))  # one lone request, its prompt in several chunks of 8:
    assert run_all(core, [("lone", prompts(16)[i], GREEDY)])[0] == {"lone/0": alone[f"{i}/0"]}
    assert not runner._loading and runner.ready_tokens == (8,)  # too few steps wanted 16 to load it again
    widths.clear()
    with caplog.at_level(logging.INFO, logger="jinfer.engine.idle_unload"):
        out, _ = run_all(core, [(f"b{r}", p, s) for r, p, s in reqs])
        assert {k[1:]: v for k, v in out.items()} == alone
        assert widths[:RELOAD_AFTER_STEPS] == [8] * RELOAD_AFTER_STEPS  # steps at the budget: they want 16
        deadline = time.monotonic() + 300
        while runner.ready_tokens != (8, 16) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert runner.ready_tokens == (8, 16) and runner.reloads == 1
    assert any(k[1] == 16 for k in runner._compiled if k[0] == "sample")
    assert "loaded the executables of bucket 16 again" in caplog.text
    assert runner.executables.hits > hits and runner.executables.misses == misses  # from disk, not compiled
    assert core.stats()["compiles_after_warmup"] == 0
    widths.clear()
    out, _ = run_all(core, [(f"c{r}", p, s) for r, p, s in reqs])
    assert {k[1:]: v for k, v in out.items()} == alone and max(widths) > 8
    warm = EngineCore(core.config)  # a warm start: the background loads the rest one at a time, in its thread
    warm.runner.warmup(first_tokens=8)
    assert warm.runner.wait_warmup(timeout=300) and warm.runner.ready_tokens == (8, 16)
    assert warm.runner.executables.misses == 0
    assert {k[1:]: v for k, v in run_all(warm, [(f"d{r}", p, s) for r, p, s in reqs])[0].items()} == alone
    # A warm start with a full (not staged) warm-up: every shape loaded from disk, no tracing or lowering at start-up
    # or while serving, the same tokens; and the keep-alive unloads nothing after it (no bucket is known to stay
    # loaded for the steps to pad into).
    del warm
    with lowerings() as lowered:
        full = EngineCore(EngineConfig(TINY, **{**kw, "warmup": True}))
        got, _ = run_all(full, [(f"e{r}", p, s) for r, p, s in reqs])
    assert full.runner.executables.misses == 0 and full.runner.executables.hits > 0
    # (the KV pool's zero-fill is a tiny jit of its own, traced per engine)
    assert [n for n in lowered if "step" in n] == [] and {k[1:]: v for k, v in got.items()} == alone
    assert full.runner.unload_idle(now=time.monotonic() + 100) == 0 and full.runner.ready_tokens == (8, 16)
    # A staged warm-up whose first bucket is not the smallest keeps the smallest loaded too: after an idle unload a
    # small batch's decode steps must not run padded into the large first bucket.
    core.runner.warmup(first_tokens=16, background=False)
    assert {(8, False), (16, False)} <= core.runner._pinned


def test_keep_alive_validated():
    with pytest.raises(ValueError, match="executable_keep_alive"):
        EngineConfig(TINY, executable_keep_alive=-1)
    # (with a full warm-up nothing is unloaded: the end of test_staged_warmup_then_idle_buckets_unload_...)


def test_warmup_first_tokens_validated():
    with pytest.raises(ValueError, match="warmup_first_tokens"):
        EngineConfig(TINY, warmup_first_tokens=0)


def test_preemption_under_tiny_pool_is_invisible(alone):
    # 24 usable pages of 4 tokens: 16 requests of up to ~50 tokens cannot all fit at once
    core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}))
    reqs = [(str(i), p, GREEDY) for i, p in enumerate(prompts(16))]
    preempted = []
    orig = core.scheduler._preempt
    core.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))[1]
    out, _ = run_all(core, reqs)
    assert preempted, "the pool was meant to be too small"
    assert out == alone
    assert core.kv.num_free_pages == core.kv.num_usable_pages


def test_chunked_prefill_equals_unchunked(alone):
    core = EngineCore(EngineConfig(TINY, **{**BASE, "max_num_batched_tokens": 8}))  # prompts up to 39 tokens
    out, _ = run_all(core, [(str(i), p, GREEDY) for i, p in enumerate(prompts(16))])
    assert out == alone


def test_prefix_cache_reuses_exact_pages_and_gives_same_output():
    core = EngineCore(EngineConfig(TINY, **BASE, async_scheduling=False))  # one output per step()
    shared = prompts(1, seed=5)[0] + prompts(1, seed=6)[0]  # a long common prefix
    a, b = shared + [7, 8, 9], shared + [10, 11]
    run_all(core, [("a", a, GREEDY)])

    # the pages of a's full prefix pages are cached after it finishes: b must get exactly those
    from jinfer.engine.request import Request
    probe = Request("probe", b, GREEDY)
    pages_a, cached = core.kv.get_computed_pages(probe)
    assert cached == (len(shared) // 4) * 4 and len(pages_a) == len(shared) // 4
    hits_before = core.kv.num_hit_tokens
    core.add_request("b", b, GREEDY)
    out_b = list(core.step()[0].new_token_ids)
    req_b = core.scheduler.requests["b"]
    assert req_b.page_ids[:len(pages_a)] == pages_a
    assert req_b.num_cached_tokens == cached and core.kv.num_hit_tokens - hits_before == cached
    while core.has_unfinished_requests():
        out_b += core.step()[0].new_token_ids
    fresh = EngineCore(EngineConfig(TINY, **{**BASE, "enable_prefix_caching": False}))
    out_b_fresh, _ = run_all(fresh, [("b", b, GREEDY)])
    assert out_b == out_b_fresh["b/0"] and len(out_b) == GREEDY.max_tokens
    assert fresh.kv.num_hit_tokens == 0


def test_abort_frees_all_pages():
    core = EngineCore(EngineConfig(TINY, **BASE))
    for i, p in enumerate(prompts(6)):
        core.add_request(str(i), p, SamplingParams(max_tokens=50, ignore_eos=True, n=2 if i == 0 else 1))
    core.step()
    core.step()
    assert core.kv.num_free_pages < core.kv.num_usable_pages
    for i in range(6):
        core.abort(str(i))
    assert core.kv.num_free_pages == core.kv.num_usable_pages
    assert not core.has_unfinished_requests() and core.step() == []


def test_seeded_sampling_is_reproducible_and_batch_independent():
    core = EngineCore(EngineConfig(TINY, **BASE))
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    p = prompts(1, seed=9)[0]
    alone, _ = run_all(core, [("x", p, sp)])
    others = [(f"o{i}", q, SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True))
              for i, q in enumerate(prompts(5, seed=3))]
    crowded, _ = run_all(core, others[:3] + [("x", p, sp)] + others[3:], arrivals=[0, 0, 1, 2, 2, 4])
    assert crowded["x/0"] == alone["x/0"]
    other_seed, _ = run_all(core, [("x", p, SamplingParams(**{**sp.to_dict(), "seed": 99}))])
    assert other_seed["x/0"] != alone["x/0"]


def test_n_samples_and_request_errors():
    core = EngineCore(EngineConfig(TINY, **BASE))
    out, finish = run_all(core, [("r", prompts(1)[0], SamplingParams(n=3, temperature=1.0, max_tokens=5,
                                                                    ignore_eos=True))])
    assert sorted(out) == ["r/0", "r/1", "r/2"] and all(len(v) == 5 for v in out.values())
    with pytest.raises(ValueError, match="context length"):
        core.add_request("long", [5] * 120, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="token ids"):
        core.add_request("bad", [5, 999], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        core.add_request("empty", [], SamplingParams())
    for bad in ([5, -1], [5, 1.5], [5, "6"], [5, 2**63], b"\x05" + bytes(7), "56"):  # range, types, int64
        with pytest.raises(ValueError, match="token ids"):
            core.add_request("bad", bad, SamplingParams())
    core.add_request("numpy", np.array([5, 6]), SamplingParams(max_tokens=1))  # numpy ids become Python ints
    assert core.scheduler.requests["numpy"].prompt_token_ids == [5, 6]
    assert all(type(t) is int for t in core.scheduler.requests["numpy"].prompt_token_ids)
    core.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    assert not core.scheduler.requests.get("long")


@contextlib.contextmanager
def lowerings():
    """Names of the functions JAX traces and lowers inside the block."""
    lowered = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kw.get("fun_name", "?"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_no_compilation_after_warmup():
    # (BASE's limits: the executables the tests above compiled come from the run's compilation cache)
    core = EngineCore(EngineConfig(TINY, **{**BASE, "warmup": True}))
    with lowerings() as lowered:
        reqs = []
        for i, p in enumerate(prompts(20, seed=11) + [list(range(3, 110))]):
            kinds = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=9, seed=i),
                     SamplingParams(temperature=1.2, top_k=5, min_p=0.05, max_tokens=17, n=2)]
            reqs.append((f"w{i}", p, kinds[i % 3]))
        run_all(core, reqs, arrivals=[(i * 7) % 13 for i in range(len(reqs))])
    assert lowered == [], f"compiled after warm-up: {lowered}"
    assert core.stats()["compiles_after_warmup"] == 0


def test_small_steps_keep_their_buffers():
    """Stable step buffers (runner.py): a decode step's inputs, logits and sampled tokens stay at the same device
    addresses from step to step (a command buffer whose buffers moved is updated, every node, before it launches)."""
    core = EngineCore(EngineConfig(TINY, **BASE))  # (BASE's shapes: compiled by the tests above)
    runner = core.runner
    core.add_request("stable", prompts(1, seed=5)[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    seen = []
    while core.has_unfinished_requests():
        core.step()
        seen.append((runner._last_tokens.unsafe_buffer_pointer(),
                     {rows: a.unsafe_buffer_pointer() for rows, a in runner._logits_out.items()},
                     {n: a.unsafe_buffer_pointer() for n, a in runner._staged.items()}))
    addresses = {}  # each buffer (the tokens; logits by rows; staged inputs by size) -> the addresses it had
    for tokens, logits, staged in seen:
        addresses.setdefault("tokens", set()).add(tokens)
        for kind, buffers in (("logits", logits), ("inputs", staged)):
            for size, a in buffers.items():
                addresses.setdefault((kind, size), set()).add(a)
    assert len(seen) >= 10 and all(len(a) == 1 for a in addresses.values()), addresses


def test_llm_api_order_n_and_validation():
    llm = LLM(TINY, **BASE)
    ps = prompts(5, seed=21)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ps
    assert all(len(o.outputs[0].token_ids) == 12 and o.outputs[0].finish_reason == "length" for o in outs)
    # same prompts in reverse order: same outputs, in the new order
    rev = llm.generate([{"prompt_token_ids": p} for p in ps[::-1]], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in rev] == [o.outputs[0].token_ids for o in outs][::-1]
    multi = llm.generate([ps[0]], SamplingParams(n=2, max_tokens=3, temperature=1.0, logprobs=2, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.index for c in multi.outputs] == [0, 1] and all(len(c.logprobs) == 3 for c in multi.outputs)
    assert all(len(lp) in (2, 3) and c.token_ids[k] in lp for c in multi.outputs for k, lp in enumerate(c.logprobs))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text needs a tokenizer")
    with pytest.raises(ValueError, match="unknown engine arguments"):
        LLM(TINY, max_batch=3)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


def test_async_scheduling_gives_the_same_outputs_as_sync(alone):
    """One step in flight (tokens fed back on the device) must not change a single token or finish
    reason: stop tokens that end requests early (their extra in-flight token is dropped), seeded
    sampling, n > 1, penalties (which force a read-back), logprobs, preemption and an abort."""
    stop_tok = alone["0/0"][5]  # greedy request 0 produces it at its 6th token
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.9, top_p=0.8, seed=7, max_tokens=10, ignore_eos=True, n=2),
        SamplingParams(temperature=1.1, top_k=8, seed=3, max_tokens=7, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, frequency_penalty=0.7),
    ]
    reqs = [(str(i), p, kinds[i % 4]) for i, p in enumerate(prompts(8))]
    arrivals = [(i * 5) % 11 for i in range(8)]
    results = {}
    for mode in (False, True):
        # (the preemption test's pool: its forward executables are this engine's too)
        core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}, async_scheduling=mode))
        preempted = []
        orig = core.scheduler._preempt
        core.scheduler._preempt = lambda r, orig=orig, seen=preempted: (seen.append(r.request_id), orig(r))[1]
        results[mode] = run_all(core, reqs, arrivals)
        assert preempted, "the pool was meant to be too small"
        assert core.kv.num_free_pages == core.kv.num_usable_pages
        # an abort while a step is in flight: nothing of it is emitted, and its pages come back
        core.add_request("late", prompts(1, seed=1)[0], SamplingParams(max_tokens=30, ignore_eos=True))
        emitted = [d for _ in range(3) for d in core.step()]
        core.abort("late")
        assert all(d.request_id == "late" for d in emitted)
        assert core.step() == [] and core.kv.num_free_pages == core.kv.num_usable_pages
    (sync_out, sync_finish), (async_out, async_finish) = results[False], results[True]
    assert async_out == sync_out and async_finish == sync_finish
    assert sync_out["0/0"] == alone["0/0"][:6] and sync_finish["0/0"] == "stop"


def test_logit_bias_and_min_tokens(alone):
    """logit_bias steers greedy decoding (+100 forces a token, -100 forbids one); min_tokens keeps the EOS and
    stop ids from being sampled (masked, not merely ignored) until min_tokens tokens exist."""
    core = EngineCore(EngineConfig(TINY, **BASE))
    p = prompts(1)[0]
    first = alone["0/0"][0]
    stop_tok = alone["0/0"][5]
    reqs = [("force", p, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={"17": 100})),
            ("forbid", p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                                         logit_bias={first: -100})),
            ("min", p, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok], min_tokens=9)),
            ("min_seeded", p, SamplingParams(temperature=1.0, seed=3, max_tokens=12, min_tokens=12,
                                             stop_token_ids=list(range(0, 256, 2))))]
    out, finish = run_all(core, reqs)
    assert out["force/0"] == [17] * 5
    assert out["forbid/0"] != [first]
    assert stop_tok not in out["min/0"][:9] and len(out["min/0"]) >= 9
    assert out["min/0"][:5] == alone["0/0"][:5]  # the same greedy path until the masked stop token
    assert len(out["min_seeded/0"]) == 12 and all(t % 2 for t in out["min_seeded/0"])  # 128 ids masked
