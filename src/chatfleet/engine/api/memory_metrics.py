"""The engine's memory breakdown (``engine/sizing/memory.py``) as Prometheus gauges.

``chatfleet:memory_bytes{class=...}``: weights by tensor class (attention, mlp, embedding,
lm_head, norms, scales, ...) and ``kv_cache`` (the device KV pool);
``chatfleet:kv_bytes_per_token{group=...}``: KV bytes one token takes per layer group;
``chatfleet:kv_cache_pool_tokens``: tokens of context the pool holds. Fixed at start-up.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from chatfleet.engine.sizing.memory import MemoryBreakdown


class MemoryCollector(Collector):
    def __init__(self, model_name: str, memory: MemoryBreakdown) -> None:
        self.model_name = model_name
        self.memory = memory

    def collect(self) -> Iterator[Metric]:
        m = self.memory
        by_class = GaugeMetricFamily("chatfleet:memory_bytes", "Bytes of weights by tensor class, and the KV pool.",
                                     labels=["model_name", "class"])
        for c in m.classes:
            if not c.skipped:
                by_class.add_metric([self.model_name, c.tensor_class], float(c.num_bytes))
        by_class.add_metric([self.model_name, "kv_cache"], float(m.kv_pool_bytes))
        yield by_class
        per_token = GaugeMetricFamily("chatfleet:kv_bytes_per_token",
                                      "KV-cache bytes one token takes, per layer group.",
                                      labels=["model_name", "group"])
        for group, n in m.kv_bytes_per_token.items():
            per_token.add_metric([self.model_name, group], float(n))
        yield per_token
        if m.pool_tokens is not None:
            pool = GaugeMetricFamily("chatfleet:kv_cache_pool_tokens", "Tokens of context the KV pool holds.",
                                     labels=["model_name"])
            pool.add_metric([self.model_name], float(m.pool_tokens))
            yield pool
