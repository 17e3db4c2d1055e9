"""The periodic engine stats line (vLLM's format): interval throughputs, queue sizes, KV usage, hit rate."""

import logging

from jinfer.engine.stats_log import StatsLogger


def test_stats_line_rates_and_quiet_when_idle(caplog):
    now = [0.0]
    logger = StatsLogger(10.0, engine_index=1, clock=lambda: now[0])
    stats = dict(prompt_tokens_total=0, generation_tokens_total=0, num_running=0, num_waiting=0, kv_usage=0.0,
                 prefix_cache_queries=0, prefix_cache_hits=0, prefix_cache_hit_rate=0.0)
    now[0] = 5.0
    assert logger.maybe_log(stats) is None  # before the interval
    now[0] = 10.0
    assert logger.maybe_log(stats) is None  # idle: nothing to say
    stats.update(prompt_tokens_total=2000, generation_tokens_total=150, num_running=3, num_waiting=2,
                 kv_usage=0.125, prefix_cache_queries=400, prefix_cache_hits=100, prefix_cache_hit_rate=0.25)
    now[0] = 20.0
    with caplog.at_level(logging.INFO, logger="jinfer.engine"):
        line = logger.maybe_log(stats)
    assert line == ("Engine 001: Avg prompt throughput: 200.0 tokens/s, Avg generation throughput: 15.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, GPU KV cache usage: 12.5%, Prefix cache hit rate: 25.0%")
    assert line in caplog.text
    stats.update(prompt_tokens_total=2100, num_running=0, num_waiting=0, kv_usage=0.0, prefix_cache_queries=500,
                 prefix_cache_hits=190)  # the interval's lookups: 90 hits of 100
    now[0] = 30.0
    assert logger.maybe_log(stats).endswith("Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%, "
                                            "Prefix cache hit rate: 90.0%")
    now[0] = 40.0  # idle now: one line with zero throughput, then quiet
    assert logger.maybe_log(stats).startswith("Engine 001: Avg prompt throughput: 0.0 tokens/s, Avg generation "
                                              "throughput: 0.0 tokens/s")
    now[0] = 50.0
    assert logger.maybe_log(stats) is None
    assert StatsLogger(0.0, clock=lambda: 1e9).maybe_log(stats) is None  # 0: off


def test_stats_line_with_the_host_tier():
    now = [0.0]
    logger = StatsLogger(10.0, clock=lambda: now[0])
    stats = dict(prompt_tokens_total=0, num_running=1, prefix_cache_queries=0, prefix_cache_hits=0,
                 prefix_cache_host_hits=0, kv_host_pages=100, kv_host_usage=0.0, kv_offload_bytes_total=0,
                 kv_restore_bytes_total=0)
    now[0] = 10.0
    logger.maybe_log(stats)
    stats.update(prefix_cache_queries=1000, prefix_cache_hits=600, prefix_cache_host_hits=250, kv_host_usage=0.5,
                 kv_offload_bytes_total=3 * 2**20, kv_restore_bytes_total=2**21)
    now[0] = 20.0
    assert logger.maybe_log(stats).endswith("Prefix cache hit rate: 60.0%, Host KV cache usage: 50.0%, host hits: "
                                            "25.0%, offloaded: 3 MiB, restored: 2 MiB")
