"""A sweep in virtual time: the bench's own ``sweep()`` (knee search), ``Bench.run_point``
(repeats, confidence intervals, pass/fail) and ``summarize`` (latencies, goodput, hit rates),
with each run served by fresh simulated replicas instead of a server. The result document is
the one a measured ``chatfleet sweep`` writes, so ``chatfleet fleet`` and the report read it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, replace

from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.server_ops import ResetCheck
from chatfleet.bench.stats import summarize
from chatfleet.bench.sweep import Bench, Observer, RunProtocol, RunRecord, SweepResult, SweepSpec, sweep
from chatfleet.bench.telemetry import Telemetry
from chatfleet.bench.workload import Workload
from chatfleet.engine.config import EngineConfig
from chatfleet.engine.outputs import SchedulerOutput
from chatfleet.plan.sim_load import TurnRequest, run_sim_load
from chatfleet.plan.sim_replica import SimReplica
from chatfleet.plan.virtual_loop import VirtualClock, run_virtual

SIM_URL = "http://simulated.invalid"  # RunProtocol needs a URL; nothing connects to it


@dataclass(frozen=True)
class ReplicaPlan:
    """Everything one simulated replica is built from."""

    engine: EngineConfig  # cache (eviction, host tier policy) and scheduler (cap, token budget)
    num_blocks: int
    num_host_blocks: int
    cost_model: Callable[[SchedulerOutput], float]
    fast: bool = True  # SimRunner without content checks
    token_scale: int = 1  # coarse time: one simulated token stands for this many (replica_setup.py)
    decode_spans: bool = True  # plain steps run by the engine's decode spans (same results)

    def build(self, name: str, clock: VirtualClock,
              on_plan: Callable[[SchedulerOutput], None] | None = None) -> SimReplica:
        return SimReplica(name, self.engine, self.num_blocks, self.cost_model, clock,
                          num_host_blocks=self.num_host_blocks, fast=self.fast, on_plan=on_plan,
                          token_scale=self.token_scale, decode_spans=self.decode_spans)


def _no_reset() -> ResetCheck:
    return ResetCheck("simulated", "skipped", None, None, "a fresh simulated replica per run")


@dataclass(frozen=True)
class RunStart:
    """What one simulated run starts from."""

    seed: int
    load: LoadSpec
    workload: Workload


class SimBench(Bench):
    """``Bench`` whose runs are simulated: one fresh replica per run (an empty cache, as the
    measured protocol's verified reset gives)."""

    def __init__(self, protocol: RunProtocol, make_workload: Callable[[int], Workload], replica: ReplicaPlan,
                 clock: VirtualClock, observer: Observer | None = None) -> None:
        self.p, self.make_workload, self.replica, self.clock = protocol, make_workload, replica, clock
        self.obs = observer or Observer()
        self.runs_done = 0
        self.busy_fraction: dict[float, float] = {}

    async def close(self) -> None:
        return None

    def _start_run(self, level: float, repeat: int, duration_s: float | None = None) -> RunStart:
        """A run's own seed (new every run, as a measured sweep's), its load and its workload."""
        seed = self.p.base_seed + 1000 * self.runs_done + 1
        self.runs_done += 1
        load = replace(self.p.load, level=level, duration_s=duration_s or self.p.load.duration_s)
        workload = self.make_workload(seed)
        self.obs.run_started(level, repeat, seed, load)
        return RunStart(seed, load, workload)

    async def run_once(self, level: float, repeat: int, extension: bool = False,
                       duration_s: float | None = None) -> RunRecord:
        start = self._start_run(level, repeat, duration_s)
        seed, load, workload = start.seed, start.load, start.workload
        replica = self.replica.build("replica-0", self.clock)
        loop_task = asyncio.create_task(replica.run())

        async def target(req: TurnRequest, rec, t0: float, intended: float) -> list[int]:
            return await replica.generate(req.request_id, req.prompt, req.max_tokens, rec, t0, intended,
                                          req.session, req.prefix_group)

        began = self.clock()
        try:
            res = await run_sim_load(workload, target, load, seed, self.clock, self.obs.record_done,
                                     token_scale=self.replica.token_scale)
        finally:
            replica.close()
            await asyncio.gather(loop_task, return_exceptions=True)
        elapsed = max(self.clock() - began, 1e-9)
        self.busy_fraction[level] = replica.busy_s / elapsed
        run = RunRecord(level, repeat, seed, _no_reset(), Telemetry("none", None), False,
                        summarize(res.records, self.p.slo, res.window_s), 0.0, res.conversations, res.records,
                        extension)
        self.obs.run_finished(run)
        return run


def simulate_sweep(protocol: RunProtocol, spec: SweepSpec, make_workload: Callable[[int], Workload],
                   replica: ReplicaPlan, observer: Observer | None = None) -> SweepResult:
    """The bench's knee search, every point simulated (one virtual-time loop for the sweep)."""
    clock = VirtualClock()
    bench = SimBench(protocol, make_workload, replica, clock, observer)
    return run_virtual(sweep(bench, spec), clock)


def simulate_point(protocol: RunProtocol, level: float, make_workload: Callable[[int], Workload],
                   replica: ReplicaPlan) -> SweepResult:
    clock = VirtualClock()
    bench = SimBench(protocol, make_workload, replica, clock)
    point = run_virtual(bench.run_point(level), clock)
    return SweepResult(protocol.load.mode, str(protocol.slo), [point], level if point.passed else None,
                       not point.passed)


def sim_protocol(load: LoadSpec, slo, repeats: int = 1, base_seed: int = 0) -> RunProtocol:
    return RunProtocol(SIM_URL, load, slo, repeats=repeats, base_seed=base_seed, server_kind="none",
                       verify_reset=False, use_gpu_telemetry=False)


def simulate_levels(protocol: RunProtocol, levels: tuple[float, ...], make_workload: Callable[[int], Workload],
                    replica: ReplicaPlan) -> dict[float, dict[str, float]]:
    """One simulated run per level -> ``{level: {"itl_p50": s, "itl_p90": s, "ttft_p50": s, ...}}``."""
    out: dict[float, dict[str, float]] = {}
    for level in levels:
        run = simulate_point(protocol, level, make_workload, replica).points[0].runs[0]
        lat = run.summary.latency
        out[level] = {f"{m}_{s}": lat[m][s] for m in ("itl", "ttft", "reply") for s in ("p50", "p90", "p99")}
    return out
