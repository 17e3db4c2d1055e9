"""Prometheus metrics of one server (its own registry, so tests can build several apps).

Two name families: jinfer's own (`jinfer_*`, labelled `replica`) and vLLM's (`vllm:*`, labelled `model_name` and
`engine` as vLLM v1's PrometheusStatLogger), so vLLM's Grafana dashboards, llm-d and sgl-model-gateway read a jinfer
server unchanged. Each quantity is declared once below (`ENGINE_SERIES`, `REQUEST_HISTOGRAMS`) with the name it
has in each family; both families are derived from that declaration, never kept in step by hand.

The engine's quantities are read from each replica's stats (its own running totals) at scrape time. The server's
per-request measurements (latencies, finish reasons) carry `engine="0"`: the server does not learn which
data-parallel replica served a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jinfer.engine.expert_load import EXPERT_TOKENS, RANK_TOKENS

STATUSES = ("success", "invalid", "unauthorized", "overloaded", "aborted", "error")
VLLM_LABELS = ("model_name", "engine")
# vLLM's FinishReason strings that jinfer produces (its series exist from the start, at 0, as vLLM's do)
FINISHED_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class Series:
    """One engine quantity: its key in the engine's stats, its jinfer name (None: vLLM's only) and its vLLM name
    (None: jinfer's only; counters without the `_total` suffix, which the exposition adds)."""

    key: str
    jinfer: str | None
    vllm: str | None
    counter: bool
    doc: str


ENGINE_SERIES = (
    Series("num_running", "jinfer_num_requests_running", "vllm:num_requests_running", False,
           "Sequences running in the engine (in its model execution batches)"),
    Series("num_waiting", "jinfer_num_requests_waiting", "vllm:num_requests_waiting", False,
           "Sequences waiting in the engine"),
    Series("kv_usage", "jinfer_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", False,
           "Fraction of KV pages in use (0..1; 1 means 100 percent usage)"),
    Series("prompt_tokens_total", None, "vllm:prompt_tokens", True, "Prompt tokens the engine took"),
    Series("generation_tokens_total", None, "vllm:generation_tokens", True, "Tokens the engine generated"),
    Series("prefix_cache_queries", None, "vllm:prefix_cache_queries", True,
           "Prefix cache queries, in prompt tokens looked up"),
    Series("prefix_cache_hits", None, "vllm:prefix_cache_hits", True,
           "Prefix cache hits, in cached tokens (HBM and host tier)"),
    Series("num_preemptions_total", None, "vllm:num_preemptions", True,
           "Preemptions (a running request's pages freed, to be recomputed)"),
    # speculative decoding: present once an engine with drafts reports them
    Series("spec_decode_num_drafts", "jinfer_spec_decode_num_drafts", "vllm:spec_decode_num_drafts", True,
           "Verifications of drafted tokens (one per sequence and step with drafts)"),
    Series("spec_decode_num_draft_tokens", "jinfer_spec_decode_num_draft_tokens",
           "vllm:spec_decode_num_draft_tokens", True, "Draft tokens verified"),
    Series("spec_decode_num_accepted_tokens", "jinfer_spec_decode_num_accepted_tokens",
           "vllm:spec_decode_num_accepted_tokens", True, "Draft tokens accepted"),
    # expert load (--expert-load-stats, jinfer/engine/expert_load.py): present once an engine counts it
    Series("expert_load_steps_total", "jinfer_expert_load_steps", None, True, "Steps whose expert load was counted"),
    Series("expert_load_imbalance", "jinfer_expert_load_last_imbalance", None, False,
           "Last step's expert-parallel imbalance: busiest rank's load over the mean rank load, over the MoE layers "
           "(1 = balanced)"),
    Series("expert_load_imbalance_sum", "jinfer_expert_load_imbalance", None, True,
           "Sum of the steps' expert-parallel imbalance (over jinfer_expert_load_steps_total: the mean)"),
    Series("expert_load_expert_imbalance_sum", "jinfer_expert_load_expert_imbalance", None, True,
           "Sum of the steps' imbalance over single experts (busiest expert's load over the mean)"),
    Series("expert_load_cumulative_imbalance", "jinfer_expert_load_cumulative_imbalance", None, False,
           "Expert-parallel imbalance of the load counted since start"),
)
_PER_POS = "spec_decode_num_accepted_tokens_per_pos_"  # + position: a labelled family of its own
# per rank and per expert: (stats key prefix, jinfer counter name, its label, doc)
_LABELLED = ((RANK_TOKENS, "jinfer_expert_load_rank_tokens", "rank",
              "(token, top-k slot) pairs routed to each expert-parallel rank's experts, summed over the MoE layers"),
             (EXPERT_TOKENS, "jinfer_expert_load_expert_tokens", "expert",
              "(token, top-k slot) pairs routed to each expert, summed over the MoE layers"))

# Latency histograms the server measures: (name without prefix, doc, vLLM's bucket boundaries, used by both families)
REQUEST_HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Request arrival to first token",
             (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0, 160.0, 640.0, 2560.0)),
    "itl": ("inter_token_latency_seconds", "Time between two tokens of a sequence",
            (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0)),
    "e2e": ("e2e_request_latency_seconds", "Request arrival to last token",
            (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
             960.0, 1920.0, 7680.0)),
}


class _TwinHistogram:
    """`jinfer_<name>` and `vllm:<name>{model_name, engine}`: one observation feeds both."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...], model_name: str, registry) -> None:
        self.jinfer = Histogram(f"jinfer_{name}", doc, buckets=buckets, registry=registry)
        self.vllm = Histogram(f"vllm:{name}", doc, VLLM_LABELS, buckets=buckets,
                              registry=registry).labels(model_name, "0")

    def observe(self, value: float) -> None:
        self.jinfer.observe(value)
        self.vllm.observe(value)


class Metrics:
    def __init__(self, model_name: str = "") -> None:
        """`model_name`: the served model name (vLLM's `model_name` label)."""
        self.model_name = model_name
        r = self.registry = CollectorRegistry()
        self.requests = Counter("jinfer_requests", "Generation requests by endpoint and outcome "
                                "(success, invalid, unauthorized, overloaded, aborted, error)",
                                ["endpoint", "status"], registry=r)
        for endpoint in ("completions", "chat"):  # every series exists from the start, at 0
            for status in STATUSES:
                self.requests.labels(endpoint, status)
        success = Counter("vllm:request_success", "Finished requests by the reason they finished (vLLM's)",
                          [*VLLM_LABELS, "finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, "0", reason) for reason in FINISHED_REASONS}
        self.prompt_tokens = Counter("jinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("jinfer_generation_tokens", "Generated tokens", registry=r)
        self.ttft, self.itl, self.e2e = (_TwinHistogram(*REQUEST_HISTOGRAMS[k], model_name, r)
                                         for k in ("ttft", "itl", "e2e"))
        self.in_flight = Gauge("jinfer_server_requests_in_flight", "Sequences the server waits on", registry=r)
        # engine gauges per data-parallel replica ("0" with one engine); ENGINE_SERIES's come from _EngineSeries
        per = dict(labelnames=["replica"], registry=r)
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
        self._engine = _EngineSeries(model_name)
        r.register(self._engine)

    def count_finished(self, status: str, finish_reason: str | None) -> None:
        """vLLM's request_success for a request that reached the engine (`status` as in STATUSES)."""
        reason = {"success": finish_reason, "aborted": "abort", "error": "error"}.get(status)
        if reason == "tool_calls":  # the server's name for a stop that ended in tool calls
            reason = "stop"
        if reason in self.request_success:
            self.request_success[reason].inc()

    def set_engine_stats(self, stats: dict[str, float], alive: bool, replica: int = 0) -> None:
        label = str(replica)
        self._engine.latest[label] = stats
        self.engine_alive.labels(label).set(1 if alive else 0)
        for gauge, key in ((self.free_pages, "num_free_pages"), (self.prefix_hit_rate, "prefix_cache_hit_rate"),
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


class _EngineSeries:
    """ENGINE_SERIES in both families from each replica's last stats; a quantity is present once a replica reports
    it (the spec_decode counters only with speculative decoding, as vLLM)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.latest: dict[str, dict[str, float]] = {}  # replica label -> its last stats

    def collect(self):
        replicas = sorted(self.latest.items())
        for s in ENGINE_SERIES:
            values = [(replica, stats[s.key]) for replica, stats in replicas if s.key in stats]
            if not values:
                continue
            family = CounterMetricFamily if s.counter else GaugeMetricFamily
            if s.jinfer:
                jinfer = family(s.jinfer, s.doc, labels=["replica"])
                for replica, value in values:
                    jinfer.add_metric([replica], value)
                yield jinfer
            if s.vllm:
                vllm = family(s.vllm, s.doc, labels=list(VLLM_LABELS))
                for replica, value in values:
                    vllm.add_metric([self.model_name, replica], value)
                yield vllm
        per_pos = [(replica, key[len(_PER_POS):], value) for replica, stats in replicas
                   for key, value in stats.items() if key.startswith(_PER_POS)]
        if per_pos:
            doc = "Draft tokens accepted at each draft position"
            jinfer = CounterMetricFamily("jinfer_spec_decode_num_accepted_tokens_per_pos", doc,
                                         labels=["replica", "position"])
            vllm = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", doc,
                                       labels=[*VLLM_LABELS, "position"])
            for replica, position, value in per_pos:
                jinfer.add_metric([replica, position], value)
                vllm.add_metric([self.model_name, replica, position], value)
            yield jinfer
            yield vllm
        for prefix, name, label, doc in _LABELLED:
            values = [(replica, key[len(prefix):], value) for replica, stats in replicas
                      for key, value in stats.items() if key.startswith(prefix)]
            if values:
                family = CounterMetricFamily(name, doc, labels=["replica", label])
                for replica, which, value in values:
                    family.add_metric([replica, which], value)
                yield family
