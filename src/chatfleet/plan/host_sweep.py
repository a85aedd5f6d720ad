"""How big the host tier must be: the returning turns' prefix-cache hit rate at one load, for a
series of host-tier sizes; the size where it stops improving is the working set of the users'
pauses (conversations whose KV the device pool evicted while their users were away)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from chatfleet.bench.records import RequestRecord
from chatfleet.bench.sweep import RunProtocol
from chatfleet.bench.workload import Workload
from chatfleet.plan.catalog import GpuSpec
from chatfleet.plan.replica_setup import ServingConfig, replica_plan
from chatfleet.plan.sim_bench import simulate_point

PLATEAU_POINTS = 0.01  # a step that adds under one point of hit rate is "no longer improving"


def returning_hit_rate(records: list[RequestRecord]) -> float | None:
    """Cached / prompt tokens over the measured, served turns after the first of each chat."""
    rs = [r for r in records if r.turn > 0 and not r.warmup and r.status == "ok" and r.prompt_tokens]
    prompt = sum(r.prompt_tokens or 0 for r in rs)
    return sum(r.cached_tokens or 0 for r in rs) / prompt if prompt else None


@dataclass(frozen=True)
class HostPoint:
    host_bytes: int
    hit_rate: float | None
    passed: bool
    ttft_p99: float | None


@dataclass(frozen=True)
class HostSweep:
    points: tuple[HostPoint, ...]

    @property
    def plateau_bytes(self) -> int | None:
        """The smallest size after which the next size adds under ``PLATEAU_POINTS`` of hit rate."""
        rates = [(p.host_bytes, p.hit_rate) for p in self.points if p.hit_rate is not None]
        for (size, rate), (_, next_rate) in itertools.pairwise(rates):
            if next_rate - rate < PLATEAU_POINTS:
                return size
        return None


def sweep_host_sizes(protocol: RunProtocol, level: float, make_workload: Callable[[int], Workload],
                     config: dict[str, Any], gpu: GpuSpec, serving: ServingConfig, sizes: list[int],
                     fast: bool = True, token_scale: int = 1) -> HostSweep:
    points = []
    for size in sorted(sizes):
        plan = replica_plan(config, gpu, replace(serving, host_cache_bytes=size), fast=fast, token_scale=token_scale)
        res = simulate_point(protocol, level, make_workload, plan)
        run = res.points[0].runs[0]
        ttft = run.summary.latency.get("ttft", {}).get("p99")
        points.append(HostPoint(size, returning_hit_rate(run.records), res.points[0].passed, ttft))
    return HostSweep(tuple(points))
