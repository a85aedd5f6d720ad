"""Gateway metrics in Prometheus text format, one private registry per gateway.

Per replica (label ``replica``): gauges ``chatfleet:gateway_in_flight``, ``_queued``, ``_cap``,
``_replica_healthy``; counters ``chatfleet:gateway_requests_total``, ``_shed_total`` (split in ``_shed_new_total`` and
``_shed_returning_total``),
``_retried_total``, ``_affinity_kept_total``, ``_affinity_broken_total``,
``_stream_breaks_total``, ``_upstream_errors_total``, ``_marked_down_total``,
``_rejoined_total``; histograms ``chatfleet:gateway_time_to_first_token_seconds`` (first byte
of the response body through the gateway), ``chatfleet:gateway_queue_wait_seconds`` and
``chatfleet:gateway_request_latency_seconds``. Gateway-wide: ``chatfleet:gateway_rejected_total``
by reason (no replica, auth, bad input, too large).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import fields

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from chatfleet.gateway.admission import AdmissionController
from chatfleet.gateway.replicas import ReplicaSet, ReplicaStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's TTFT buckets, so the same dashboards read both.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)

_COUNTER_HELP = {
    "requests": "Responses started, any status",
    "shed": "Requests answered 429 (queue full or wait too long)",
    "shed_new": "First turns of new conversations answered 429",
    "shed_returning": "Returning turns of conversations in progress answered 429",
    "retried": "Requests that failed on this replica before their first byte and were retried",
    "affinity_kept": "Keyed requests served by their home replica",
    "affinity_broken": "Keyed requests whose home is this replica, served elsewhere",
    "stream_breaks": "Streams broken after their first byte (ended with an SSE error event)",
    "upstream_errors": "Failed upstream calls: connect errors, timeouts, 5xx, broken streams",
    "marked_down": "Times this replica was marked down",
    "rejoined": "Times this replica came back",
}
assert set(_COUNTER_HELP) == {f.name for f in fields(ReplicaStats)}


class _StateCollector:
    def __init__(self, replicas: ReplicaSet, admission: AdmissionController) -> None:
        self.replicas = replicas
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        gauges = {
            "in_flight": GaugeMetricFamily("chatfleet:gateway_in_flight", "Requests holding a slot",
                                           labels=["replica"]),
            "queued": GaugeMetricFamily("chatfleet:gateway_queued", "Requests waiting for a slot", labels=["replica"]),
            "cap": GaugeMetricFamily("chatfleet:gateway_cap", "In-flight cap (+Inf: none)", labels=["replica"]),
            "healthy": GaugeMetricFamily("chatfleet:gateway_replica_healthy", "1 if routable", labels=["replica"]),
        }
        counters = {name: CounterMetricFamily(f"chatfleet:gateway_{name}", text, labels=["replica"])
                    for name, text in _COUNTER_HELP.items()}
        for url, replica in self.replicas.replicas.items():
            gauges["in_flight"].add_metric([url], self.admission.in_flight(url))
            gauges["queued"].add_metric([url], self.admission.queued(url))
            cap = self.admission.cap(url)
            gauges["cap"].add_metric([url], math.inf if cap == math.inf else cap)
            gauges["healthy"].add_metric([url], 1.0 if replica.healthy else 0.0)
            for name, family in counters.items():
                family.add_metric([url], getattr(replica.stats, name))
        yield from gauges.values()
        yield from counters.values()


class GatewayMetrics:
    def __init__(self, replicas: ReplicaSet, admission: AdmissionController) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_StateCollector(replicas, admission))
        self._ttft = self._histogram("chatfleet:gateway_time_to_first_token_seconds",
                                     "Arrival to first response byte, through the gateway")
        self._queue_wait = self._histogram("chatfleet:gateway_queue_wait_seconds", "Time waiting for an admission slot")
        self._latency = self._histogram("chatfleet:gateway_request_latency_seconds",
                                        "Arrival to the end of the response")
        self._rejected = Counter("chatfleet:gateway_rejected", "Requests refused before routing",
                                 ["reason"], registry=self.registry)
        self._children: dict[tuple[int, str], Histogram] = {}

    def _histogram(self, name: str, documentation: str) -> Histogram:
        """A per-replica latency histogram on this gateway's registry."""
        return Histogram(name, documentation, labelnames=["replica"], buckets=LATENCY_BUCKETS, registry=self.registry)

    def _child(self, histogram: Histogram, replica: str) -> Histogram:
        key = (id(histogram), replica)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = histogram.labels(replica)
        return child

    def observe_ttft(self, replica: str, seconds: float) -> None:
        self._child(self._ttft, replica).observe(seconds)

    def observe_queue_wait(self, replica: str, seconds: float) -> None:
        self._child(self._queue_wait, replica).observe(seconds)

    def observe_latency(self, replica: str, seconds: float) -> None:
        self._child(self._latency, replica).observe(seconds)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
