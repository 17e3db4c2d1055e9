"""The KV host tier (`--kv-offload-gb`): restored vs recomputed prefixes, warm-hit TTFT, multi-turn chat.

    python -m benchmarks.bench_kv_offload --shape qwen3-4b --out $OUT/kv_offload_qwen3-4b_h100.json
    python -m benchmarks.bench_kv_offload --tiny          # CPU check at toy sizes (tests/data/tiny-qwen3)

Drives EngineCore directly (no server), token ids only. Every engine has the same HBM pool (`num_pages`,
sized to ~1/4 of the chat's final histories) and max_model_len, so they share their executables.
(a) A 16k-token prefix: TTFT of prefix + 1 token when the prefix is new (cold: computed), cached in HBM
    (warm), and evicted to the host tier by other prompts (restored): one step of one token after the
    copy. The restore's achieved host-to-device bandwidth (an instrumented run: the restore's copies are
    timed until the cache is ready) against a plain `jax.device_put` from pinned host memory.
(b) Warm HBM hits at several lengths: TTFT of prefix + 1 token with the prefix cached, right after the cold
    prefill (its evictions and write-back may still be copying to the host) and once those copies landed.
(c) Multi-turn chat, closed loop: S sessions x N turns, each turn re-sends the history plus a new user
    message; TTFT p50/p99 and throughput with the tier and without.
Each TTFT starts from an idle engine (the device drained) and ends when the first token is on the host.
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from benchmarks.common import add_profile_argument, environment, profiled, write_result
from jinfer.cache.transfer import BLOCK_PAGES, host_memory_kind
from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.engine.request import Request
from jinfer.sampling_params import SamplingParams

# prefix (a), warm-hit lengths (b), chat (sessions, turns, system, user, output tokens), bandwidth probe bytes
SIZES = {
    "gpu": dict(prefix=16384, warm_lens=(1024, 16384, 32768), sessions=64, turns=8, system=768, user=128,
                output=64, probe_bytes=1 << 30, page_size=16, max_num_batched_tokens=2048, reps=3, warm_reps=5),
    "tiny": dict(prefix=256, warm_lens=(64, 256, 512), sessions=16, turns=4, system=96, user=16, output=8,
                 probe_bytes=1 << 24, page_size=16, max_num_batched_tokens=256, reps=2, warm_reps=3),
}


VOCAB = [1000]  # token ids are drawn below this (min(1000, the model's vocabulary))


def tokens(rng, n: int) -> list[int]:
    return rng.integers(0, VOCAB[0], n).tolist()


def measure_host_to_device(nbytes: int, page_bytes: int) -> dict:
    """Copy rates between pinned host memory and the device: one large array each way, and the restore's
    pattern (one `device_put` of a list of page-sized arrays)."""
    dev = jax.devices()[0]
    on_dev = SingleDeviceSharding(dev)
    kind = host_memory_kind(dev)
    host = on_dev.with_memory_kind(kind)
    x = jax.device_put(np.ones(nbytes, np.uint8), host).block_until_ready()

    def best(f, reps=5):
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            jax.block_until_ready(f())
            times.append(time.perf_counter() - t)
        return min(times)

    h2d = nbytes / best(lambda: jax.device_put(x, on_dev))
    y = jax.device_put(x, on_dev).block_until_ready()
    d2h = nbytes / best(lambda: jax.device_put(y, host))
    n = max(1, min(256, nbytes // page_bytes))
    pages = [jax.device_put(np.ones(page_bytes, np.uint8), host) for _ in range(n)]
    jax.block_until_ready(pages)
    pages_h2d = n * page_bytes / best(lambda: jax.device_put(pages, on_dev))
    # the tier's pattern: blocks of BLOCK_PAGES pages, one copy each
    nb = max(1, n // BLOCK_PAGES)
    blocks = [jax.device_put(np.ones(BLOCK_PAGES * page_bytes, np.uint8), host) for _ in range(nb)]
    jax.block_until_ready(blocks)
    blocks_h2d = nb * BLOCK_PAGES * page_bytes / best(lambda: jax.device_put(blocks, on_dev))
    # offloading blocks into host memory the allocator has not grown to yet, then into memory it has freed
    # (kv_transfer.HostKVPool.reserve): the device_put's host time, where the pinned allocation is paid
    dev_block = jax.device_put(np.ones(BLOCK_PAGES * page_bytes, np.uint8), on_dev)
    alloc = {}
    for name in ("fresh", "reused"):
        t = time.perf_counter()
        held = [jax.device_put(dev_block, host) for _ in range(max(1, 2 * nbytes // dev_block.nbytes))]
        alloc[f"d2h_blocks_dispatch_s_{name}"] = time.perf_counter() - t
        jax.block_until_ready(held)
        alloc[f"d2h_blocks_ready_s_{name}"] = time.perf_counter() - t
        del held
    return {**alloc, "memory_kind": kind, "bytes": nbytes, "h2d_Bps": h2d, "d2h_Bps": d2h,
            "pages_h2d_Bps": pages_h2d, "pages_probe": n, "page_bytes": page_bytes,
            "blocks_h2d_Bps": blocks_h2d, "block_pages": BLOCK_PAGES}


def measure_copy_overlap(nbytes: int) -> dict:
    """Does a copy between the device and pinned host memory hold up computations launched after it, or the
    read-back of their results? The time to finish a tiny jitted op launched right behind each kind of copy
    of `nbytes` (and to read its result back to numpy), against no copy."""
    dev = jax.devices()[0]
    on_dev = SingleDeviceSharding(dev)
    host = on_dev.with_memory_kind(host_memory_kind(dev))
    tiny = jax.jit(lambda a: a * 2 + 1)
    z = jax.device_put(np.ones(1024, np.float32), on_dev)
    y = jax.device_put(np.ones(nbytes, np.uint8), on_dev).block_until_ready()
    x = jax.device_put(y, host).block_until_ready()
    to_host_jit = jax.jit(lambda a: a, out_shardings=host)
    def waiter(a):
        return lambda: jax.block_until_ready(a)

    def to_numpy():
        y.copy_to_host_async()
        return lambda: np.asarray(y)

    copies = {"none": lambda: lambda: None, "d2h_device_put": lambda: waiter(jax.device_put(y, host)),
              "d2h_jit_out_sharding": lambda: waiter(to_host_jit(y)),
              "h2d_device_put": lambda: waiter(jax.device_put(x, on_dev)), "d2h_copy_to_host_async": to_numpy}
    out = {}
    for name, copy in copies.items():
        waits = (("tiny_op", lambda: tiny(z).block_until_ready()), ("read_back", lambda: np.asarray(tiny(z))))
        for then, wait in waits:
            rows = []
            for _ in range(4):
                jax.block_until_ready((y, x, tiny(z)))
                t0 = time.perf_counter()
                c = copy()
                t1 = time.perf_counter()
                wait()
                t2 = time.perf_counter()
                c()
                rows.append((t1 - t0, t2 - t1, time.perf_counter() - t0))
            best = min(rows, key=lambda r: r[2])
            out[f"{name}/{then}"] = {"dispatch_ms": best[0] * 1e3, "after_ms": best[1] * 1e3,
                                     "copy_done_ms": best[2] * 1e3}
            print(f"copy overlap: {name}: dispatch {best[0] * 1e3:.2f} ms, then a {then} done in "
                  f"{best[1] * 1e3:.2f} ms, the copy in {best[2] * 1e3:.2f} ms")
    return {"bytes": nbytes, **out}


def drain(core: EngineCore) -> None:
    while core.has_unfinished_requests() or core._inflight is not None:
        core.step()
    core.idle()  # as the engine's loop does when it goes idle
    jax.block_until_ready(core.runner.kv_cache)


def ttft_ms(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 1) -> float:
    """First-token latency of one request on an idle engine."""
    drain(core)
    t0 = time.perf_counter()
    core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    first = None
    while first is None:
        if any(o.new_token_ids for o in core.step()):
            first = time.perf_counter() - t0
    drain(core)
    return first * 1e3


class Phases:
    """Host time of a TTFT's phases: the engine methods below are wrapped (on the instance) while active."""

    WRAPPED = (("add", "core", "add_request"), ("schedule", "scheduler", "schedule"),
               ("transfer", "runner", "transfer"), ("launch", "runner", "launch"),
               ("fetch", "runner", "fetch"), ("complete", "core", "_complete"))

    def __init__(self, core: EngineCore):
        self.core, self.ms = core, {}

    def __enter__(self):
        for name, owner, attr in self.WRAPPED:
            obj = self.core if owner == "core" else getattr(self.core, owner)
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))
        return self

    def _timed(self, name, f):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
        return wrapped

    def __exit__(self, *exc):
        for _, owner, attr in self.WRAPPED:
            obj = self.core if owner == "core" else getattr(self.core, owner)
            del obj.__dict__[attr]  # back to the class's method


def where_cached(core: EngineCore, prompt: list[int]) -> tuple[int, int]:
    """(pages found in HBM, pages found in the host tier) for a prompt's prefix."""
    pages, _ = core.kv.get_computed_pages(Request("probe", prompt))
    return sum(p > 0 for p in pages), sum(p < 0 for p in pages)


def evict(core: EngineCore, prefix: list[int], rng, fill_len: int) -> int:
    """Run other prompts until no page of `prefix` is left in HBM; returns how many it took."""
    for i in range(16):
        if where_cached(core, prefix + [0])[0] == 0:
            return i
        ttft_ms(core, f"fill-{rng.integers(1 << 62)}", tokens(rng, fill_len))
    raise RuntimeError("the prefix stayed in HBM")


def part_a(core: EngineCore, s: dict, rng) -> dict:
    """16k prefix: cold vs warm HBM vs restored from the host tier."""
    rows = []
    L, fill = s["prefix"], s["prefix"]
    for r in range(s["reps"]):
        prefix = tokens(rng, L)
        cold = ttft_ms(core, f"cold{r}", prefix + [1])
        warm = ttft_ms(core, f"warm{r}", prefix + [2])
        fills = evict(core, prefix, rng, fill)
        hbm, host = where_cached(core, prefix + [3])
        host_hits = core.kv.num_host_hit_tokens
        restored = ttft_ms(core, f"restored{r}", prefix + [3])
        rows.append({"cold_ms": cold, "warm_hbm_ms": warm, "restored_ms": restored, "fills": fills,
                     "pages_in_host_before": host, "restored_tokens": core.kv.num_host_hit_tokens - host_hits})
        print(f"(a) {L} tokens: cold {cold:.1f} ms, warm HBM {warm:.1f} ms, restored {restored:.1f} ms "
              f"({cold / restored:.1f}x faster than cold)")
    # the restore's copy rate: the same again, with the restore's copies timed until the cache is ready
    prefix = tokens(rng, L)
    ttft_ms(core, "bw-cold", prefix + [1])
    evict(core, prefix, rng, fill)
    timed, transfer = [], core.runner.transfer

    def timed_transfer(t):
        jax.block_until_ready(core.runner.kv_cache)
        t0 = time.perf_counter()
        dropped = transfer(t)
        t1 = time.perf_counter()
        jax.block_until_ready(core.runner.kv_cache)
        timed.append({"restores": len(t.restores), "offloads": len(t.offloads), "dispatch_ms": (t1 - t0) * 1e3,
                      "ready_ms": (time.perf_counter() - t0) * 1e3, **core.runner.host_pool.last_apply})
        return dropped

    core.runner.transfer = timed_transfer
    try:
        instrumented = ttft_ms(core, "bw-restored", prefix + [3])
    finally:
        core.runner.transfer = transfer
    page_bytes = core.runner.host_pool.page_bytes
    restore = max(timed, key=lambda t: t["restores"])
    restore_Bps = restore["restores"] * page_bytes / (restore["ready_ms"] / 1e3)
    med = lambda k: float(np.median([row[k] for row in rows]))
    return {"prefix_tokens": L, "reps": rows, "cold_ms": med("cold_ms"), "warm_hbm_ms": med("warm_hbm_ms"),
            "restored_ms": med("restored_ms"), "restored_speedup_vs_cold": med("cold_ms") / med("restored_ms"),
            "restore_bytes": restore["restores"] * page_bytes, "restore_copies": timed,
            "restore_Bps": restore_Bps, "instrumented_restored_ms": instrumented}


def part_b(core: EngineCore, s: dict, rng, profile: str | None = None) -> list[dict]:
    rows = []
    for L in s["warm_lens"]:
        prefix = tokens(rng, L)
        cold = ttft_ms(core, f"b-cold{L}", prefix)
        warm = [ttft_ms(core, f"b-warm{L}-{i}", prefix + [int(rng.integers(0, VOCAB[0]))])
                for i in range(s["warm_reps"])]
        settled = []  # the same once the host copies queued by the prefills before (evictions, write-back) landed
        for i in range(3):
            drain(core)
            core.runner.host_pool.wait_offloads()
            settled.append(ttft_ms(core, f"b-settled{L}-{i}", prefix + [int(rng.integers(0, VOCAB[0]))]))
        phases = []  # the same again with the host's phases timed (fetch: waiting for the device + read-back)
        for i in range(3):
            drain(core)
            with Phases(core) as p:
                ms = ttft_ms(core, f"b-phases{L}-{i}", prefix + [int(rng.integers(0, VOCAB[0]))])
            phases.append({"ttft_ms": ms, **{k: round(v, 3) for k, v in p.ms.items()}})
        with profiled(profile and f"{profile}/warm{L}"):
            for i in range(3):
                ttft_ms(core, f"b-profile{L}-{i}", prefix + [int(rng.integers(0, VOCAB[0]))])
        rows.append({"prefix_tokens": L, "cold_ms": cold, "warm_ms": warm, "warm_p50_ms": float(np.median(warm)),
                     "warm_min_ms": min(warm), "warm_settled_ms": settled, "phases_ms": phases})
        print(f"(b) warm HBM hit at {L} tokens: TTFT p50 {np.median(warm):.1f} ms (min {min(warm):.1f}; "
              f"{np.median(settled):.1f} with no host copy in flight; cold {cold:.1f} ms); phases of one (ms): "
              f"{phases[-1]}")
    return rows


def part_c(core: EngineCore, s: dict, seed: int) -> dict:
    """Closed-loop chat: every session sends its next turn as soon as its previous one finished."""
    drain(core)
    rng = np.random.default_rng(seed)  # the same conversation for every configuration
    S, N = s["sessions"], s["turns"]
    history = [tokens(rng, s["system"]) for _ in range(S)]
    messages = [[tokens(rng, s["user"]) for _ in range(N)] for _ in range(S)]
    params = SamplingParams(temperature=0.0, max_tokens=s["output"], ignore_eos=True)
    sent, prompt_of, turn, outputs, ttfts = {}, {}, [0] * S, {}, []
    kv = core.kv
    hits0 = (kv.num_hit_tokens, kv.num_host_hit_tokens, kv.num_query_tokens)
    preempted, preempt = [0], core.scheduler._preempt
    core.scheduler._preempt = lambda r: (preempted.__setitem__(0, preempted[0] + 1), preempt(r))[1]

    def send(i):
        rid = f"chat-{seed}-{i}-{turn[i]}"
        prompt_of[rid] = history[i] + messages[i][turn[i]]
        core.add_request(rid, prompt_of[rid], params)
        sent[rid], outputs[rid] = time.perf_counter(), []

    t0 = time.perf_counter()
    for i in range(S):
        send(i)
    done = 0
    while done < S * N:
        for o in core.step():
            if o.new_token_ids and not outputs[o.request_id]:
                ttfts.append((turn[int(o.request_id.split("-")[2])], (time.perf_counter() - sent[o.request_id]) * 1e3))
            outputs[o.request_id] += o.new_token_ids
            if o.finished:
                i = int(o.request_id.split("-")[2])
                history[i] = prompt_of[o.request_id] + outputs[o.request_id]
                turn[i] += 1
                done += 1
                if turn[i] < N:
                    send(i)
    wall = time.perf_counter() - t0
    drain(core)
    core.scheduler._preempt = preempt
    all_ms = np.asarray([ms for _, ms in ttfts])
    later = np.asarray([ms for t, ms in ttfts if t > 0])
    pct = lambda a, q: float(np.percentile(a, q))
    queried = kv.num_query_tokens - hits0[2]
    out_tokens = S * N * s["output"]
    return {"sessions": S, "turns": N, "final_history_tokens": int(np.mean([len(h) for h in history])),
            "wall_s": wall, "output_tok_per_s": out_tokens / wall,
            "requests_per_s": S * N / wall,
            "ttft_p50_ms": pct(all_ms, 50), "ttft_p99_ms": pct(all_ms, 99),
            "ttft_later_turns_p50_ms": pct(later, 50), "ttft_later_turns_p99_ms": pct(later, 99),
            "prompt_tokens": queried, "hbm_hit_tokens": kv.num_hit_tokens - hits0[0],
            "host_hit_tokens": kv.num_host_hit_tokens - hits0[1],
            "computed_prompt_tokens": queried - (kv.num_hit_tokens - hits0[0]) - (kv.num_host_hit_tokens - hits0[1]),
            "preemptions": preempted[0], **{k: v for k, v in core.stats().items() if k.startswith("kv_")}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", help="named shape (dummy weights) or a model path")
    ap.add_argument("--tiny", action="store_true", help="toy sizes on tests/data/tiny-qwen3 (a CPU check)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (float32 with --tiny)")
    ap.add_argument("--kv-offload-gb", type=float, default=None, help="host tier (default 24 GiB; 0.05 with --tiny)")
    ap.add_argument("--parts", default="abc", help="which parts to run (a, b, c; p alone: the copy probes)")
    ap.add_argument("--out")
    add_profile_argument(ap)
    args = ap.parse_args()
    s = SIZES["tiny" if args.tiny else "gpu"]
    shape = "tests/data/tiny-qwen3" if args.tiny else args.shape
    model = shape if "/" in shape else f"dummy:{shape}"
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    host_gb = args.kv_offload_gb if args.kv_offload_gb is not None else (0.05 if args.tiny else 24.0)
    ps = s["page_size"]
    final = s["system"] + s["turns"] * (s["user"] + s["output"])
    num_pages = -(-s["sessions"] * final // 4 // ps) + 1  # HBM holds ~1/4 of the sessions' final histories
    max_model_len = max(s["warm_lens"]) + 64
    assert (num_pages - 1) * ps > max_model_len, "the warm-hit prompts must fit the pool"
    common = dict(model=model, dtype=dtype, page_size=ps, num_pages=num_pages, max_model_len=max_model_len,
                  max_num_seqs=s["sessions"], max_num_batched_tokens=s["max_num_batched_tokens"],
                  warmup=not args.tiny)
    result = {"benchmark": "kv_offload", **environment(), "shape": shape, "dtype": dtype, "sizes": s,
              "num_pages": num_pages, "page_size": ps, "max_model_len": max_model_len, "kv_offload_gb": host_gb}
    if args.parts == "p":  # the copy probes only (no engine)
        result["copy_overlap"] = measure_copy_overlap(s["prefix"] * 147456)  # a 16k prefix of Qwen3-4B KV
        return write_result(result, args.out)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(**common, kv_offload_gb=host_gb))
    result["startup_s"] = time.perf_counter() - t0
    VOCAB[0] = min(1000, core.model_config.vocab_size)
    result["host_tier_pages"] = core.kv.host.num_slots
    result["page_bytes"] = core.runner.host_pool.page_bytes
    drain(core)
    result["bandwidth"] = measure_host_to_device(s["probe_bytes"], core.runner.host_pool.page_bytes)
    bw = result["bandwidth"]
    print(f"pinned host -> device {bw['h2d_Bps'] / 1e9:.1f} GB/s ({bw['pages_h2d_Bps'] / 1e9:.1f} GB/s in pages, "
          f"{bw['blocks_h2d_Bps'] / 1e9:.1f} in blocks), device -> host {bw['d2h_Bps'] / 1e9:.1f} GB/s; offloading "
          f"blocks: host dispatch {bw['d2h_blocks_dispatch_s_fresh']:.2f} s fresh, "
          f"{bw['d2h_blocks_dispatch_s_reused']:.2f} s into freed memory")
    ttft_ms(core, "compile", tokens(rng, 3 * ps + 1))  # first use of the transfer shapes
    if "a" in args.parts:
        a = result["prefix"] = part_a(core, s, rng)
        a["restore_fraction_of_h2d"] = a["restore_Bps"] / bw["h2d_Bps"]
        r = max(a["restore_copies"], key=lambda t: t["restores"])
        print(f"(a) restore at {a['restore_Bps'] / 1e9:.1f} GB/s = {100 * a['restore_fraction_of_h2d']:.0f}% of "
              f"the measured host -> device rate (its batch: {r['restores']} restores + {r['offloads']} offloads, "
              f"ready in {r['ready_ms']:.1f} ms, host dispatch {r['dispatch_ms']:.1f} ms: offloads "
              f"{1e3 * r.get('offload_s', 0):.1f}, restore copies {1e3 * r.get('restore_put_s', 0):.1f}, scatters "
              f"{1e3 * r.get('scatter_s', 0):.1f} ms)")
    if "b" in args.parts:
        result["warm_hits"] = part_b(core, s, rng, args.profile)
    if "c" in args.parts:
        core.kv.reset_prefix_cache()
        chat = {"with_tier": part_c(core, s, seed=1)}
        del core
        gc.collect()
        core = EngineCore(EngineConfig(**common))
        chat["without_tier"] = part_c(core, s, seed=1)
        for k, v in chat.items():
            print(f"(c) chat {k}: TTFT p50 {v['ttft_p50_ms']:.1f} ms, p99 {v['ttft_p99_ms']:.1f} ms, "
                  f"{v['output_tok_per_s']:.0f} output tok/s, {v['wall_s']:.1f} s, prompt tokens computed "
                  f"{v['computed_prompt_tokens']} of {v['prompt_tokens']}")
        result["chat"] = chat
    result["total_s"] = time.perf_counter() - t0
    write_result(result, args.out)


if __name__ == "__main__":
    main()
