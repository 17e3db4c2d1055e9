"""Prometheus metrics of one server (its own registry, so tests can build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
STATUSES = ("success", "invalid", "unauthorized", "overloaded", "aborted", "error")
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jinfer_requests", "Generation requests by endpoint and outcome "
                                "(success, invalid, unauthorized, overloaded, aborted, error)",
                                ["endpoint", "status"], registry=r)
        for endpoint in ("completions", "chat"):  # every series exists from the start, at 0
            for status in STATUSES:
                self.requests.labels(endpoint, status)
        self.prompt_tokens = Counter("jinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("jinfer_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("jinfer_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("jinfer_inter_token_latency_seconds", "Time between two tokens of a sequence",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("jinfer_e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=_E2E_BUCKETS, registry=r)
        self.in_flight = Gauge("jinfer_server_requests_in_flight", "Sequences the server waits on", registry=r)
        # engine gauges per data-parallel replica ("0" with one engine)
        per = dict(labelnames=["replica"], registry=r)
        self.running = Gauge("jinfer_num_requests_running", "Sequences running in the engine", **per)
        self.waiting = Gauge("jinfer_num_requests_waiting", "Sequences waiting in the engine", **per)
        self.kv_usage = Gauge("jinfer_kv_cache_usage_ratio", "Fraction of KV pages in use (0..1)", **per)
        self.free_pages = Gauge("jinfer_kv_cache_free_pages", "Free KV pages", **per)
        self.prefix_hit_rate = Gauge("jinfer_prefix_cache_hit_rate", "Prefix-cache hit rate over prompt tokens",
                                     **per)
        self.tier_hit_rate = Gauge("jinfer_prefix_cache_tier_hit_rate", "Prefix-cache hits in one tier (hbm, host) "
                                   "over prompt tokens looked up", labelnames=["replica", "tier"], registry=r)
        self.host_pages = Gauge("jinfer_kv_host_cache_pages", "KV pages the host tier holds (--kv-offload-gb)", **per)
        self.host_usage = Gauge("jinfer_kv_host_cache_usage_ratio", "Fraction of the host tier's pages in use "
                                "(0..1)", **per)
        self.tier_bytes = Gauge("jinfer_kv_host_transfer_bytes", "KV bytes copied between HBM and the host tier "
                                "since start (to_host: evicted pages saved; to_device: host hits restored)",
                                labelnames=["replica", "direction"], registry=r)
        self.engine_alive = Gauge("jinfer_engine_alive", "1 while the engine process serves", **per)
        self.late_compiles = Gauge("jinfer_compiles_after_warmup", "Shapes the engine compiled after its warm-up "
                                   "(each stalled a step)", **per)
        self.warmup_pending = Gauge("jinfer_warmup_pending_shapes", "Step shapes a staged warm-up is still "
                                    "compiling in the background (0: serving at full speed)", **per)
        self.unloads = Gauge("jinfer_executable_unloads", "Step shapes dropped as idle since start "
                             "(--executable-keep-alive)", **per)
        self.reloads = Gauge("jinfer_executable_reloads", "Dropped step shapes loaded again since start", **per)

        self._spec = _SpecDecodeCounters()  # the engines' speculative-decoding counters, as vLLM names them
        r.register(self._spec)

    def set_engine_stats(self, stats: dict[str, float], alive: bool, replica: int = 0) -> None:
        label = str(replica)
        if "spec_decode_num_drafts" in stats:
            self._spec.latest[label] = stats
        self.engine_alive.labels(label).set(1 if alive else 0)
        for gauge, key in ((self.running, "num_running"), (self.waiting, "num_waiting"),
                           (self.kv_usage, "kv_usage"), (self.free_pages, "num_free_pages"),
                           (self.prefix_hit_rate, "prefix_cache_hit_rate"),
                           (self.late_compiles, "compiles_after_warmup"),
                           (self.warmup_pending, "warmup_pending"),
                           (self.unloads, "executable_unloads_total"), (self.reloads, "executable_reloads_total")):
            if key in stats:
                gauge.labels(label).set(stats[key])
        if "kv_host_pages" in stats:  # the host tier is on
            for tier in ("hbm", "host"):
                self.tier_hit_rate.labels(label, tier).set(stats.get(f"prefix_cache_{tier}_hit_rate", 0.0))
            self.host_pages.labels(label).set(stats["kv_host_pages"])
            self.host_usage.labels(label).set(stats["kv_host_usage"])
            self.tier_bytes.labels(label, "to_host").set(stats["kv_offload_bytes_total"])
            self.tier_bytes.labels(label, "to_device").set(stats["kv_restore_bytes_total"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodeCounters:
    """vLLM's spec_decode counters from each engine's totals (its stats): jinfer_spec_decode_num_drafts_total,
    _num_draft_tokens_total, _num_accepted_tokens_total, and _num_accepted_tokens_per_pos_total{position}.
    Present once an engine with speculative decoding reports."""

    _NAMES = (("num_drafts", "Verifications of drafted tokens (one per sequence and step with drafts)"),
              ("num_draft_tokens", "Draft tokens verified"), ("num_accepted_tokens", "Draft tokens accepted"))

    def __init__(self) -> None:
        self.latest: dict[str, dict[str, float]] = {}  # replica label -> its last stats

    def collect(self):
        if not self.latest:
            return
        for name, doc in self._NAMES:
            family = CounterMetricFamily(f"jinfer_spec_decode_{name}", doc, labels=["replica"])
            for replica, stats in sorted(self.latest.items()):
                family.add_metric([replica], stats.get(f"spec_decode_{name}", 0))
            yield family
        per_pos = CounterMetricFamily("jinfer_spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position", labels=["replica", "position"])
        prefix = "spec_decode_num_accepted_tokens_per_pos_"
        for replica, stats in sorted(self.latest.items()):
            for key, value in stats.items():
                if key.startswith(prefix):
                    per_pos.add_metric([replica, key[len(prefix):]], value)
        yield per_pos
