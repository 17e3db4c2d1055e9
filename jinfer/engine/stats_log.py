"""The engine's periodic stats line, like vLLM's:

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 42.0%

Throughputs are averages over the interval (`--log-stats-interval`, default 10 s; 0 turns the line off);
the prefix-cache hit rate is over the interval's lookups (the lifetime rate when there were none); with a
KV host tier (`--kv-offload-gb`) the line adds its usage, its share of the hits and the interval's copies; with
speculative decoding a second line gives the interval's mean acceptance length and per-position rates, with
`--expert-load-stats` another the interval's expert-load imbalance (jinfer/engine/expert_load.py). An idle
engine logs once after its last busy interval, then stays quiet (as vLLM does).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("jinfer.engine")


class StatsLogger:
    def __init__(self, interval: float, engine_index: int = 0, clock=time.monotonic):
        self.interval, self.engine_index, self.clock = interval, engine_index, clock
        self._last: dict[str, float] | None = None
        self._last_time = clock()
        self._was_busy = False

    def maybe_log(self, stats: dict[str, float]) -> str | None:
        """Log (and return) the line if an interval has passed since the last one; None otherwise."""
        now = self.clock()
        if self.interval <= 0 or now - self._last_time < self.interval:
            return None
        last, self._last = self._last, dict(stats)
        elapsed, self._last_time = now - self._last_time, now
        if last is None:
            last = {}
        delta = lambda key: stats.get(key, 0.0) - last.get(key, 0.0)
        prompt_tps = delta("prompt_tokens_total") / elapsed
        gen_tps = delta("generation_tokens_total") / elapsed
        busy = bool(prompt_tps or gen_tps or stats.get("num_running") or stats.get("num_waiting"))
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        queries = delta("prefix_cache_queries")
        hit_rate = delta("prefix_cache_hits") / queries if queries > 0 else stats.get("prefix_cache_hit_rate", 0.0)
        line = (f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt_tps:.1f} tokens/s, "
                f"Avg generation throughput: {gen_tps:.1f} tokens/s, Running: {int(stats.get('num_running', 0))} "
                f"reqs, Waiting: {int(stats.get('num_waiting', 0))} reqs, GPU KV cache usage: "
                f"{100 * stats.get('kv_usage', 0.0):.1f}%, Prefix cache hit rate: {100 * hit_rate:.1f}%")
        if "kv_host_pages" in stats:  # the host tier: its share of the hits, its usage, the interval's copies
            host = delta("prefix_cache_host_hits") / queries if queries > 0 else 0.0
            line += (f", Host KV cache usage: {100 * stats.get('kv_host_usage', 0.0):.1f}%, host hits: "
                     f"{100 * host:.1f}%, offloaded: {delta('kv_offload_bytes_total') / 2**20:.0f} MiB, restored: "
                     f"{delta('kv_restore_bytes_total') / 2**20:.0f} MiB")
        log.info(line)
        for extra in (spec_decoding_line(stats, last, self.engine_index),
                      expert_load_line(stats, last, self.engine_index)):
            if extra is not None:
                log.info(extra)
                line += "\n" + extra
        return line


def expert_load_line(stats: dict[str, float], last: dict[str, float], engine_index: int = 0) -> str | None:
    """The interval's expert load: its steps' mean imbalance over the expert-parallel ranks and over the experts (max
    / mean load: 1.0 is balanced), and the rank imbalance of the counts since start; None without steps counted."""
    delta = lambda key: stats.get(key, 0) - last.get(key, 0)
    steps = delta("expert_load_steps_total")
    if steps <= 0:
        return None
    ranks, since_start = int(stats.get("expert_load_ranks", 1)), stats.get("expert_load_cumulative_imbalance", 1.0)
    return (f"Engine {engine_index:03d}: Expert load: {int(steps)} steps, imbalance over {ranks} rank(s) "
            f"{delta('expert_load_imbalance_sum') / steps:.3f} (since start {since_start:.3f}), "
            f"over experts {delta('expert_load_expert_imbalance_sum') / steps:.3f}")


def spec_decoding_line(stats: dict[str, float], last: dict[str, float], engine_index: int = 0) -> str | None:
    """The interval's speculative decoding (as vLLM logs it): mean acceptance length (1 + accepted drafts per
    verification), drafted and accepted tokens, and each draft position's acceptance rate; None without drafts."""
    delta = lambda key: stats.get(key, 0) - last.get(key, 0)
    drafts = delta("spec_decode_num_drafts")
    if drafts <= 0:
        return None
    accepted, drafted = delta("spec_decode_num_accepted_tokens"), delta("spec_decode_num_draft_tokens")
    rates, i = [], 0
    while f"spec_decode_num_accepted_tokens_per_pos_{i}" in stats:
        rates.append(delta(f"spec_decode_num_accepted_tokens_per_pos_{i}") / drafts)
        i += 1
    return (f"Engine {engine_index:03d}: SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
            f"Accepted: {int(accepted)} tokens, Drafted: {int(drafted)} tokens, Per-position acceptance rate: "
            f"{', '.join(f'{r:.3f}' for r in rates)}, Avg Draft acceptance rate: "
            f"{100 * accepted / max(drafted, 1):.1f}%")
