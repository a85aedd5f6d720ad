"""A fleet in virtual time: N simulated replicas behind the gateway's own routing
(``gateway/routing.py``: bounded-load consistent hashing on the session key) and admission
(``gateway/admission.py``: per-replica caps, one bounded priority queue, returning turns first),
with the gateway's defaults (``GatewayConfig``). A shed request is a 429 in its record, as the
bench records it against a real gateway.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from chatfleet.bench.records import RequestRecord
from chatfleet.bench.stats import summarize
from chatfleet.bench.sweep import Observer, RunProtocol, RunRecord
from chatfleet.bench.telemetry import Telemetry
from chatfleet.bench.workload import Workload
from chatfleet.gateway.admission import AdmissionController, Priority
from chatfleet.gateway.config import GatewayConfig
from chatfleet.gateway.routing import Affinity, make_routing_policy
from chatfleet.plan.sim_bench import ReplicaPlan, SimBench, _no_reset
from chatfleet.plan.sim_load import TurnRequest, run_sim_load
from chatfleet.plan.virtual_loop import VirtualClock


@dataclass(frozen=True)
class FleetStats:
    """How evenly the gateway spread one run's requests."""

    requests_per_replica: tuple[int, ...]
    affinity_broken: int
    shed: int

    @property
    def imbalance(self) -> float:
        """Busiest replica's requests / the mean (1.0: perfectly even)."""
        mean = sum(self.requests_per_replica) / len(self.requests_per_replica)
        return max(self.requests_per_replica) / mean if mean else 1.0


class FleetBench(SimBench):
    """``SimBench`` whose every run is a fleet of ``num_replicas`` behind the gateway's code."""

    def __init__(self, protocol: RunProtocol, make_workload: Callable[[int], Workload], replica: ReplicaPlan,
                 clock: VirtualClock, num_replicas: int, gateway: GatewayConfig | None = None,
                 observer: Observer | None = None) -> None:
        super().__init__(protocol, make_workload, replica, clock, observer)
        self.num_replicas = num_replicas
        self.gateway = gateway or GatewayConfig()
        self.fleet_stats: dict[float, FleetStats] = {}

    async def run_once(self, level: float, repeat: int, extension: bool = False,
                       duration_s: float | None = None) -> RunRecord:
        start = self._start_run(level, repeat, duration_s)
        seed, load, workload = start.seed, start.load, start.workload
        names = [f"replica-{i}" for i in range(self.num_replicas)]
        replicas = {n: self.replica.build(n, self.clock) for n in names}
        tasks = [asyncio.create_task(r.run()) for r in replicas.values()]
        g = self.gateway
        cap = self.replica.engine.scheduler.max_running if g.max_in_flight is None else g.max_in_flight
        routing = make_routing_policy(g.routing_policy, names, virtual_nodes=g.virtual_nodes, load_factor=g.load_factor)
        admission = AdmissionController({n: cap for n in names}, queue_size=g.queue_size,
                                        max_wait_s=g.max_queue_wait_s, retry_after_s=g.retry_after_s, clock=self.clock)
        served: Counter[str] = Counter()
        broken = shed = 0

        async def target(req: TurnRequest, rec: RequestRecord, t0: float, intended: float) -> list[int]:
            nonlocal broken, shed
            full = [n for n in names if admission.is_full(n)]
            decision = routing.route(req.session, names, admission.loads(), full)
            broken += decision.affinity is Affinity.BROKEN
            priority = Priority.RETURNING if req.returning else Priority.FIRST
            adm = await admission.admit(decision.replica, priority, self.clock() + g.max_queue_wait_s)
            if not adm.admitted:
                shed += 1
                rec.status, rec.http_status, rec.error = "rate_limited", 429, f"gateway: {adm.reason}"
                rec.sent_s = self.clock() - t0
                return []
            served[decision.replica] += 1
            try:
                return await replicas[decision.replica].generate(req.request_id, req.prompt, req.max_tokens, rec,
                                                                 t0, intended, req.session, req.prefix_group)
            finally:
                admission.release(decision.replica)

        try:
            res = await run_sim_load(workload, target, load, seed, self.clock, self.obs.record_done,
                                     token_scale=self.replica.token_scale)
        finally:
            for r in replicas.values():
                r.close()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.fleet_stats[level] = FleetStats(tuple(served[n] for n in names), broken, shed)
        run = RunRecord(level, repeat, seed, _no_reset(), Telemetry("none", None), False,
                        summarize(res.records, self.p.slo, res.window_s), 0.0, res.conversations, res.records,
                        extension)
        self.obs.run_finished(run)
        return run


def naive_fleet_size(peak_chats: int, knee: float) -> int:
    """'Peak / chats per replica', the way fleets are sized from one replica's knee."""
    return math.ceil(peak_chats / knee - 1e-9)


@dataclass(frozen=True)
class FleetTrial:
    replicas: int
    passed: bool
    imbalance: float
    shed: int
    affinity_broken: int


@dataclass(frozen=True)
class FleetSizing:
    peak_chats: int
    knee: float  # one replica's
    naive: int  # ceil(peak / knee)
    needed: int | None  # the fewest replicas that met the SLO at the peak (None: none tried did)
    trials: tuple[FleetTrial, ...]

    @property
    def extra(self) -> int | None:
        """Replicas uneven traffic adds to (or, negative, saves from) the naive size."""
        return None if self.needed is None else self.needed - self.naive


def size_fleet(protocol: RunProtocol, make_workload: Callable[[int], Workload], replica: ReplicaPlan,
               peak_chats: int, knee: float, max_extra: int = 4, gateway: GatewayConfig | None = None) -> FleetSizing:
    """Simulate the fleet at the peak with the naive size, then grow (or shrink) it until the
    SLO is met with the fewest replicas."""
    from chatfleet.plan.virtual_loop import run_virtual

    naive = naive_fleet_size(peak_chats, knee)
    trials: dict[int, FleetTrial] = {}

    def trial(n: int) -> bool:
        clock = VirtualClock()
        bench = FleetBench(protocol, make_workload, replica, clock, n, gateway)
        point = run_virtual(bench.run_point(float(peak_chats)), clock)
        st = bench.fleet_stats[float(peak_chats)]
        trials[n] = FleetTrial(n, point.passed, st.imbalance, st.shed, st.affinity_broken)
        return point.passed

    needed: int | None = None
    if trial(naive):
        needed = naive
        while needed > 1 and trial(needed - 1):
            needed -= 1
    else:
        for n in range(naive + 1, naive + max_extra + 1):
            if trial(n):
                needed = n
                break
    return FleetSizing(peak_chats, knee, naive, needed, tuple(trials[n] for n in sorted(trials)))
