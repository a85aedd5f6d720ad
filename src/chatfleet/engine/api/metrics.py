"""Prometheus metrics of one engine server, under the names vLLM exports.

Gauges and engine totals are sampled from ``Engine.stats()`` at scrape time; latency
histograms and request counts are observed by the server per request (``RequestTimer``).
Each app has its own ``CollectorRegistry``, so several servers can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Engine.stats() field -> (metric name, kind, help). Counters get `_total` in the exposition.
_FROM_STATS = (
    ("num_running", "vllm:num_requests_running", "gauge", "Requests in the running batch."),
    ("num_waiting", "vllm:num_requests_waiting", "gauge", "Requests waiting to be scheduled."),
    ("kv_usage", "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage: 1 means 100 percent."),
    ("prefix_cache_queries", "vllm:prefix_cache_queries", "counter",
     "Prefix-cache queries, in tokens."),
    ("prefix_cache_hits", "vllm:prefix_cache_hits", "counter", "Prefix-cache hits, in tokens."),
    ("prompt_tokens", "vllm:prompt_tokens", "counter", "Prefill tokens processed."),
    ("generation_tokens", "vllm:generation_tokens", "counter", "Generation tokens processed."),
    ("num_preemptions", "vllm:num_preemptions", "counter", "Preemptions (by recompute)."),
    ("num_blocks", "chatfleet:kv_cache_num_blocks", "gauge", "KV blocks in the pool."),
    ("block_size", "chatfleet:kv_cache_block_size", "gauge", "Tokens per KV block."),
    ("num_cached_blocks", "chatfleet:kv_cache_cached_blocks", "gauge",
     "KV blocks holding a prefix hash (in use or not)."),
    ("num_evictions", "chatfleet:prefix_cache_evictions", "counter",
     "Cached KV blocks reused for other content."),
    # host tier (only with --host-cache-memory); vLLM 0.32's names for its CPU offloading
    # connector where one means the same thing
    ("host_num_blocks", "chatfleet:host_cache_num_blocks", "gauge", "KV blocks in the host tier."),
    ("host_usage", "vllm:kv_offload_cpu_cache_usage_perc", "gauge",
     "Host-tier blocks holding KV: 1 means 100 percent."),
    ("host_cache_queries", "chatfleet:host_cache_queries", "counter",
     "Prompt tokens the device cache missed, looked up in the host tier."),
    ("host_cache_queries", "vllm:external_prefix_cache_queries", "counter",
     "Prefix-cache queries to the host tier, in tokens."),
    ("host_cache_hits", "chatfleet:host_cache_hits", "counter", "Tokens found in the host tier."),
    ("host_cache_hits", "vllm:external_prefix_cache_hits", "counter",
     "Prefix-cache hits in the host tier, in tokens."),
    ("host_cache_misses", "chatfleet:host_cache_misses", "counter",
     "Tokens the host tier did not hold either (computed)."),
    ("host_promotions", "chatfleet:host_cache_promotions", "counter",
     "KV blocks loaded host -> device."),
    ("host_demotions", "chatfleet:host_cache_demotions", "counter",
     "KV blocks stored device -> host on device eviction."),
    ("host_demotions_skipped", "vllm:kv_offload_stores_skipped", "counter",
     "Device evictions whose block the host tier already held."),
    ("host_demotions_dropped", "chatfleet:host_cache_demotions_dropped", "counter",
     "Device evictions lost because every host block was in flight."),
    ("host_evictions", "chatfleet:host_cache_evictions", "counter",
     "Host-tier blocks reused for other content."),
    ("kv_bytes_loaded", "vllm:kv_offload_load_bytes", "counter", "Bytes loaded host -> device."),
    ("kv_bytes_stored", "vllm:kv_offload_store_bytes", "counter", "Bytes stored device -> host."),
    ("kv_seconds_loading", "vllm:kv_offload_load_time", "counter",
     "Seconds spent loading host -> device."),
    ("kv_seconds_storing", "vllm:kv_offload_store_time", "counter",
     "Seconds spent storing device -> host."),
)


class _StatsCollector(Collector):
    """Yields the last engine-stats snapshot (set by the /metrics route before rendering)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None
        self.alive = True
        self.open_streams = 0

    def collect(self) -> Iterator[Metric]:
        labels = [self.model_name]
        for field, name, kind, doc in _FROM_STATS:
            value = getattr(self.stats, field, None) if self.stats is not None else None
            if value is None:
                continue
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                name, doc, labels=["model_name"]
            )
            family.add_metric(labels, float(value))
            yield family
        alive = GaugeMetricFamily("chatfleet:engine_alive", "1 while the engine loop runs.",
                                  labels=["model_name"])
        alive.add_metric(labels, 1.0 if self.alive else 0.0)
        yield alive
        streams = GaugeMetricFamily("chatfleet:open_requests",
                                    "Requests with an open HTTP handler.", labels=["model_name"])
        streams.add_metric(labels, float(self.open_streams))
        yield streams


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats = _StatsCollector(model_name)
        self.registry.register(self._stats)
        lab = ["model_name"]
        r = self.registry
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                             lab, buckets=ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             lab, buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", lab,
                                    buckets=E2E_BUCKETS, registry=r).labels(model_name)
        self._success = Counter("vllm:request_success", "Finished requests.",
                                lab + ["finished_reason"], registry=r)
        self._rejected = Counter("chatfleet:requests_rejected",
                                 "Requests the engine refused at admission, by HTTP status.",
                                 lab + ["status"], registry=r)
        self._resets = Counter("chatfleet:prefix_cache_resets", "Calls of /reset_prefix_cache.",
                               lab + ["emptied"], registry=r)

    def prefix_cache_reset(self, emptied: bool) -> None:
        self._resets.labels(self.model_name, "true" if emptied else "false").inc()

    def request_finished(self, finish_reason: str | None) -> None:
        self._success.labels(self.model_name, finish_reason or "unknown").inc()

    def request_rejected(self, status_code: int) -> None:
        self._rejected.labels(self.model_name, str(status_code)).inc()

    def render(self, stats: EngineStats | None, *, alive: bool, open_requests: int) -> bytes:
        """Prometheus text, with gauges and engine totals from ``stats`` (may be None)."""
        self._stats.stats = stats
        self._stats.alive = alive
        self._stats.open_streams = open_requests
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's TTFT, inter-token latency and end-to-end latency.

    Queue time is observed on the engine thread (``AsyncEngine.on_first_scheduled``).
    """

    def __init__(self, metrics: ServerMetrics, arrival: float | None = None) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic() if arrival is None else arrival
        self.last: float | None = None
        self.finished = False

    def on_abort(self) -> None:
        """The request ended before its last output (the client left, its deadline passed): counted
        as vLLM counts it, ``vllm:request_success_total{finished_reason="abort"}``."""
        if not self.finished:
            self.finished = True
            self.metrics.request_finished("abort")

    def on_output(self, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.new_token_ids:
            if self.last is None:
                self.metrics.ttft.observe(now - self.arrival)
            else:
                self.metrics.itl.observe(now - self.last)
            self.last = now
        if out.finished and not self.finished:
            self.finished = True
            self.metrics.e2e.observe(now - self.arrival)
            self.metrics.request_finished(out.finish_reason)
