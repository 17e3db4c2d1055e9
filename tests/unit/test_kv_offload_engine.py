"""The KV host tier in the engine (tiny Llama, float32): pages evicted from an HBM pool that holds a fraction of
the working set come back from host memory with their exact contents, under preemption, n > 1 and aborts."""

import numpy as np
import pytest

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.engine.request import Request
from jinfer.sampling_params import SamplingParams

from .test_engine import BASE, TINY, run_all

PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers x (k, v) x page_size x kv heads x head_dim x float32
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONGER = dict(temperature=0.0, max_tokens=16, ignore_eos=True)  # the second round grows: preemptions


def host_gb(pages: int) -> float:
    return pages * PAGE_BYTES / 2**30


def sessions(n=6, seed=3):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, size=int(rng.integers(24, 34))).tolist() for _ in range(n)]


def two_rounds(core: EngineCore, concurrent: bool, idle: bool = False):
    """Each session's prompt, then (after all of them) the prompt extended: the second round finds the
    first round's prefix in the cache, or, when HBM is too small, in the host tier. `idle`: the engine's
    loop calls `idle()` whenever it has run out of requests."""
    first = [(f"a{i}", p, GREEDY) for i, p in enumerate(sessions())]
    out = {}
    for r in first:
        out.update(run_all(core, [r])[0])
        if idle:
            core.idle()
    second = [(f"b{i}", p + [5, 6, 7, 8, 9], SamplingParams(**LONGER, n=2 if i == 1 else 1))
              for i, p in enumerate(sessions())]
    if concurrent:
        out.update(run_all(core, second)[0])
    else:
        for r in second:
            out.update(run_all(core, [r])[0])
    return out


@pytest.fixture(scope="module")
def reference():
    """A pool that holds every session: nothing is ever evicted."""
    core = EngineCore(EngineConfig(TINY, **BASE))
    out = two_rounds(core, concurrent=False)
    assert core.kv.num_hit_tokens > 0
    return out


def test_offloaded_prefixes_come_back_exact(reference):
    # 24 usable pages of 4 tokens hold about two sessions' histories; the host tier holds all of them
    core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}, kv_offload_gb=host_gb(64)))
    assert core.kv.host.num_slots == 64 and core.runner.host_pool.page_bytes == PAGE_BYTES
    out = two_rounds(core, concurrent=False)
    assert out == reference
    stats = core.stats()
    assert core.kv.num_host_hit_tokens > 0 and stats["kv_restore_bytes_total"] > 0
    assert stats["kv_offload_bytes_total"] >= stats["kv_restore_bytes_total"] > 0
    assert stats["prefix_cache_host_hits"] == core.kv.num_host_hit_tokens
    assert core.kv.num_free_pages == core.kv.num_usable_pages
    assert core.runner.host_pool.num_used_slots == core.kv.host.num_used_slots == stats["kv_host_used_pages"]
    # jax 0.11's CPU backend has pinned_host too: the same code path as on GPU (the offload thread's copies)
    core.runner.host_pool.wait_offloads()
    held = [block.array for block, _ in filter(None, core.runner.host_pool.slots)]
    assert {a.sharding.memory_kind for a in held} == {"pinned_host"}
    # /metrics: the engine's stats (as the engine process sends them) become the tier's gauges
    from server.metrics import Metrics
    m = Metrics()
    m.set_engine_stats(stats, True)
    text = m.render().decode()
    restored = float(stats["kv_restore_bytes_total"])
    assert f'jinfer_kv_host_transfer_bytes{{direction="to_device",replica="0"}} {restored}' in text
    host_rate = stats["prefix_cache_host_hit_rate"]
    assert 0 < host_rate and f'jinfer_prefix_cache_tier_hit_rate{{replica="0",tier="host"}} {host_rate}' in text
    assert f'jinfer_kv_host_cache_usage_ratio{{replica="0"}} {stats["kv_host_usage"]}' in text


def test_written_back_pages_come_back_exact(reference):
    # write-back: freed cached pages go to the host tier in batches of 3 and when the engine goes idle, so
    # the evictions find them there and the restores' batches carry (almost) no offloads
    core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}, kv_offload_gb=host_gb(64)))
    core.kv.host.write_back_pages = 3
    batches, transfer = [], core.runner.transfer
    core.runner.transfer = lambda t: batches.append(t) or transfer(t)
    out = two_rounds(core, concurrent=True, idle=True)
    assert out == reference
    assert core.kv.num_host_hit_tokens > 0
    restoring = [t for t in batches if t.restores]
    # the first restoring schedule evicts only first-round pages, all written back already (19 offloads without)
    assert restoring and restoring[0].offloads == [] and len(restoring[0].restores) > 8
    assert core.kv.host.num_offloaded_pages == sum(len(t.offloads) for t in batches)
    assert core.kv.num_free_pages == core.kv.num_usable_pages


def test_blocks_restore_from_hbm_until_their_host_copy_lands(reference):
    # the offload thread held back: every block keeps its HBM copy, and restores read it
    core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}, kv_offload_gb=host_gb(64)))
    pool = core.runner.host_pool
    pool._offloader = "held back"  # no thread is started
    assert two_rounds(core, concurrent=False) == reference and core.kv.num_host_hit_tokens > 0
    held = [block.array for block, _ in filter(None, pool.slots)]
    assert held and {a.sharding.memory_kind for a in held} == {"device"}
    pool._offloader = None
    pool._offload(held[0][:1], 1)  # the next offload starts the thread, which copies every queued block
    pool.wait_offloads()
    assert {block.array.sharding.memory_kind for block, _ in filter(None, pool.slots)} == {"pinned_host"}
    pool.join()


def test_restores_under_preemption_and_a_small_host_pool(reference):
    # the second round runs all at once: preemptions; the host tier holds 12 pages (its LRU evicts)
    core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}, kv_offload_gb=host_gb(24)))
    preempted = []
    orig = core.scheduler._preempt
    core.scheduler._preempt = lambda r: (preempted.append(r.request_id), orig(r))[1]
    out = two_rounds(core, concurrent=True)
    assert out == reference and preempted
    assert core.kv.num_host_hit_tokens > 0
    assert core.kv.host.num_used_slots == 24 and core.runner.host_pool.num_used_slots == 24
    assert core.kv.host.num_offloaded_pages > 24  # the bound held while more went through
    assert core.kv.num_free_pages == core.kv.num_usable_pages


def test_abort_mid_restore_leaks_nothing():
    core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}, kv_offload_gb=host_gb(64)))
    prompts = sessions()
    for i, p in enumerate(prompts):
        run_all(core, [(f"a{i}", p, GREEDY)])
    hits = core.kv.num_host_hit_tokens
    core.add_request("x", prompts[0] + [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True, n=2))
    core.step()  # the restore and the first step are launched, not read back
    assert core.kv.num_host_hit_tokens > hits
    core.abort("x")
    while core.has_unfinished_requests():
        core.step()
    core.step()
    assert core.kv.num_free_pages == core.kv.num_usable_pages
    assert core.kv.take_transfers() is None and not core.kv.host._pinned
    assert core.runner.host_pool.num_used_slots == core.kv.host.num_used_slots <= 64
    # the engine goes on, and the aborted request's restored pages serve the next one from HBM
    hbm = core.kv.num_hit_tokens
    out, _ = run_all(core, [("y", prompts[0] + [1, 2, 3], GREEDY)])
    assert core.kv.num_hit_tokens > hbm and len(out["y/0"]) == GREEDY.max_tokens


def test_kv_offload_gb_validated():
    with pytest.raises(ValueError, match="kv_offload_gb"):
        EngineConfig(TINY, kv_offload_gb=-1)
    with pytest.raises(ValueError, match="kv_offload_gb"):
        EngineConfig(TINY, kv_offload_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_gb"):
        EngineCore(EngineConfig(TINY, **BASE, kv_offload_gb=1e-9))  # less than a page


@pytest.mark.parametrize("tier", ["hbm", "host"])
def test_warm_hit_is_a_one_token_decode_step(tier):
    """A prompt whose every token but the last is cached (in HBM, or restored from the host tier) reaches its
    first token with one step of one token, which the runner sends to the decode-only executable (on the GPU:
    the paged decode kernel; on CPU the decode executables exist only for the Pallas backend, so the test
    makes bucket 8 one and checks the choice, running the step on the usual executable)."""
    core = EngineCore(EngineConfig(TINY, **{**BASE, "num_pages": 25}, kv_offload_gb=host_gb(64)))
    runner = core.runner
    assert runner.page_buckets[-1] * 4 >= core.max_model_len  # the page-table width covers the context
    seen = []
    run_forward = runner.run_forward
    runner.run_forward = lambda T, B, P, decode, *a: (seen.append((T, decode)), run_forward(T, B, P, False, *a))[1]
    runner.ready_decode = frozenset({8})
    rng = np.random.default_rng(9)
    prefix = rng.integers(3, 256, 32).tolist()  # 8 full pages
    run_all(core, [("warm", prefix, GREEDY)])
    if tier == "host":  # push the prefix out of HBM
        run_all(core, [("other", rng.integers(3, 256, 80).tolist(), GREEDY)])
        pages, _ = core.kv.get_computed_pages(Request("probe", prefix + [42]))
        assert len(pages) == 8 and min(pages) < 0
    hbm, host = core.kv.num_hit_tokens, core.kv.num_host_hit_tokens
    seen.clear()
    core.add_request("hit", prefix + [42], GREEDY)
    core.step()
    assert seen == [(8, True)]  # one token, the decode executable
    assert core.scheduler.requests["hit"].num_cached_tokens == 32
    hits = (core.kv.num_hit_tokens - hbm, core.kv.num_host_hit_tokens - host)
    assert sum(hits) == 32 and (hits[1] == 0 if tier == "hbm" else hits[1] >= 16)  # a tail in the host tier
    while core.has_unfinished_requests():
        core.step()


def test_host_blocks_restore_rows_and_stay_bounded():
    """HostKVPool alone: pages offloaded in blocks come back bit-exact into other pages; reassigning most
    slots of the blocks makes the pool drop the sparsest blocks (bounded host memory) and the tier forget
    exactly those slots."""
    import jax
    import jax.numpy as jnp

    from jinfer.cache.host_tier import HostTier
    from jinfer.cache.transfer import BLOCK_PAGES, MAX_HELD_RATIO, HostKVPool

    rng = np.random.default_rng(0)
    pages, layers = 64, 2
    on_mesh = jax.sharding.NamedSharding(jax.make_mesh((1,), ("tp",)), jax.sharding.PartitionSpec())
    cache = tuple(tuple(jax.device_put(jnp.asarray(rng.standard_normal((pages, 4, 2, 8)), jnp.float32), on_mesh)
                        for _ in range(2)) for _ in range(layers))
    original = jax.tree.map(np.asarray, cache)
    num_slots = 24
    pool, tier = HostKVPool(cache, num_slots), HostTier(num_slots)
    cache = pool.warmup(cache)
    # offload pages 1..20 (two blocks: 16 + 4 rows), then restore 5 of them into pages 40..44
    for p in range(1, 21):
        tier.offload(p, bytes([p]))
    cache, dropped = pool.apply(cache, tier.take_transfers())
    blocks = [min(BLOCK_PAGES, 20 - i) for i in range(0, 20, BLOCK_PAGES)]  # pages per block, padded to 2^k
    assert not dropped and pool.num_used_slots == 20 and pool.held_pages == sum(1 << (n - 1).bit_length()
                                                                                for n in blocks)
    for i, p in enumerate([3, 17, 18, 1, 20]):
        tier.restore(bytes([p]), 40 + i)
    cache, dropped = pool.apply(cache, tier.take_transfers())
    got = jax.tree.map(np.asarray, cache)
    for i, p in enumerate([3, 17, 18, 1, 20]):
        for (k, v), (k0, v0) in zip(got, original, strict=True):
            np.testing.assert_array_equal(k[40 + i], k0[p])
            np.testing.assert_array_equal(v[40 + i], v0[p])
    # new content reassigns slots one page at a time, leaving older blocks with a few live rows each
    forgotten = 0
    for p in range(21, 81):
        tier.offload(p % pages or 1, bytes([p % 256, 1]))
        cache, dropped = pool.apply(cache, tier.take_transfers())
        tier.forget(dropped)
        forgotten += len(dropped)
        assert pool.held_pages <= MAX_HELD_RATIO * num_slots + 1
        assert pool.num_used_slots == tier.num_used_slots
        assert all(tier.lookup(d) is None or pool.slots[tier.lookup(d)] is not None for d in tier._lru)
    assert pool.held_pages <= MAX_HELD_RATIO * num_slots and forgotten > 0
    pool.reserve()  # the start-up growth of the host allocator (a background thread on GPU) runs anywhere


def test_fp8_pages_round_trip():
    """An FP8 cache (k, v, k_scale, v_scale per layer): its e4m3 pages go to host memory and come back into other
    pages bit for bit, a page's bytes are half of bf16's, and the scales (the layers', not a page's) stay."""
    import jax
    import jax.numpy as jnp

    from jinfer.cache.host_tier import HostTier
    from jinfer.cache.transfer import HostKVPool

    rng = np.random.default_rng(5)
    on_mesh = jax.sharding.NamedSharding(jax.make_mesh((1,), ("tp",)), jax.sharding.PartitionSpec())
    f8 = jnp.float8_e4m3fn
    cache = tuple((*(jax.device_put(jnp.asarray(rng.standard_normal((16, 4, 2, 8)), f8), on_mesh) for _ in range(2)),
                   *(jax.device_put(jnp.asarray([0.5, 2.0], jnp.float32), on_mesh) for _ in range(2)))
                  for _ in range(2))
    original = jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32)), cache)
    pool, tier = HostKVPool(cache, 8), HostTier(8)
    assert pool.page_dtype == f8 and pool.page_bytes == 2 * 2 * 4 * 2 * 8  # layers x (k, v) x page x heads x dim
    for p in (3, 5, 6):
        tier.offload(p, bytes([p]))
    cache, _ = pool.apply(cache, tier.take_transfers())
    for i, p in enumerate((6, 3)):
        tier.restore(bytes([p]), 10 + i)
    cache, _ = pool.apply(cache, tier.take_transfers())
    got = jax.tree.map(lambda a: np.asarray(a.astype(jnp.float32)), cache)
    for layer, before in zip(got, original, strict=True):
        for i, p in enumerate((6, 3)):
            np.testing.assert_array_equal(layer[0][10 + i], before[0][p])
            np.testing.assert_array_equal(layer[1][10 + i], before[1][p])
        np.testing.assert_array_equal(layer[2], before[2])
        np.testing.assert_array_equal(layer[3], before[3])
    assert all(a.dtype == f8 for layer in cache for a in layer[:2])


def test_host_copies_wait_for_read_backs_while_the_engine_runs(monkeypatch):
    """Device -> host copies share a stream with the steps' read-backs, so while the engine runs requests a
    block's copy waits until a read-back leaves it room before the next one is due; idle, it goes at once."""
    import time

    import jax
    import jax.numpy as jnp

    from jinfer.cache import transfer as kv_transfer
    from jinfer.cache.transfer import HostKVPool

    monkeypatch.setattr(kv_transfer, "PACE_TIMEOUT_S", 30.0)  # no fallback turn within the test
    on_mesh = jax.sharding.NamedSharding(jax.make_mesh((1,), ("tp",)), jax.sharding.PartitionSpec())
    cache = tuple(tuple(jax.device_put(jnp.ones((8, 4, 2, 8), jnp.float32), on_mesh) for _ in range(2))
                  for _ in range(2))
    pool = HostKVPool(cache, 16)

    def offload():
        block = pool._offload(pool._gather(cache, np.arange(1, 3, dtype=np.int32)), 2)
        time.sleep(0.2)
        return block

    def landed(block):
        return block.array.sharding.memory_kind == "pinned_host"

    try:
        pool.hold()
        block = offload()
        assert not landed(block)  # the engine runs: no read-back yet
        pool.read_back()  # the first: the step interval is not known yet
        time.sleep(0.2)
        assert not landed(block)
        pool.read_back()  # 0.2 s after the one before: the next is due 0.2 s from now, room for the copy
        pool.wait_offloads()
        assert landed(block)
        time.sleep(0.25)  # the next read-back is due now: no room for another copy
        block = offload()
        assert not landed(block)
        pool.release()  # idle: copies go at once
        pool.wait_offloads()
        assert landed(block)
        block = offload()
        pool.wait_offloads()
        assert landed(block)
    finally:
        pool.join()


def test_offline_generate_writes_back_when_done():
    # LLM.generate goes idle as the server's loop does: the cached pages still waiting for write-back go out
    from jinfer import LLM

    llm = LLM(TINY, **{**BASE, "num_pages": 25}, kv_offload_gb=host_gb(64))
    host = llm.engine.kv.host
    host.write_back_pages = 1000  # no batch fills up: only going idle sends them
    llm.generate([{"prompt_token_ids": p} for p in sessions(3)], GREEDY, use_tqdm=False)
    assert not host._waiting and host.num_offloaded_pages > 0
    llm.engine.runner.host_pool.wait_offloads()
    assert llm.engine.runner.host_pool.num_used_slots == host.num_used_slots > 0


def test_offload_thread_lets_a_discarded_pool_go():
    # the kv-offload thread holds its pool weakly: a pool nobody uses is freed (its host blocks with it) and the
    # thread ends; join() leaves wait_offloads() returning; a copy that fails leaves the thread running
    import gc
    import threading
    import weakref

    import jax
    import jax.numpy as jnp

    from jinfer.cache.transfer import HostKVPool

    on_mesh = jax.sharding.NamedSharding(jax.make_mesh((1,), ("tp",)), jax.sharding.PartitionSpec())
    cache = tuple(tuple(jax.device_put(jnp.ones((8, 4, 2, 8), jnp.float32), on_mesh) for _ in range(2))
                  for _ in range(2))
    pool = HostKVPool(cache, 16)
    pool.release()
    pool._offload(pool._gather(cache, np.arange(1, 3, dtype=np.int32)), 2)
    pool._offload("not an array", 1)  # its copy raises: logged, the thread goes on
    block = pool._offload(pool._gather(cache, np.arange(3, 5, dtype=np.int32)), 2)
    pool.wait_offloads()
    assert block.array.sharding.memory_kind == "pinned_host"
    pool.join()
    done = threading.Thread(target=pool.wait_offloads, daemon=True)
    done.start()
    done.join(5)
    assert not done.is_alive()
    # (a new pool: pytest's log capture keeps the failed copy's traceback, which holds the first one)
    pool = HostKVPool(cache, 16)
    pool.release()
    block = pool._offload(pool._gather(cache, np.arange(1, 3, dtype=np.int32)), 2)
    pool.wait_offloads()
    thread, ref = pool._offloader, weakref.ref(pool)
    del pool, block
    gc.collect()
    thread.join(5)
    assert ref() is None and not thread.is_alive()
