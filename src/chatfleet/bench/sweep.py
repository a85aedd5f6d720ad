"""Run protocol and knee search.

Every run: reset the server's prefix cache and verify it, take a fresh seed, sample clocks,
warm up (excluded), measure. A load point is repeated and reported with confidence intervals;
runs under the clock floor are set aside (and rerun once). The sweep raises the load until the
SLO breaks, then bisects: the knee is the highest load that meets it.

With a ``confidence`` level a point is judged by intervals over its requests pooled
(``point_verdict``): it passes only where every target's interval meets the SLO, fails only where
one breaks it, and an undecided point is measured again, one run of the same length at a time, up
to ``extend_up_to`` times its repeats. A knee is never called on an undecided point.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from chatfleet.bench.breakdown import Breakdown, breakdown
from chatfleet.bench.client import ClientConfig
from chatfleet.bench.loops import LoadResult, LoadSpec, run_load
from chatfleet.bench.point_verdict import PointVerdict, judge_point
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.server_ops import ResetCheck, ServerControl
from chatfleet.bench.slo import SLO
from chatfleet.bench.stats import Interval, RunSummary, confidence_interval, summarize
from chatfleet.bench.telemetry import Telemetry, TelemetrySampler, run_floor, throttled
from chatfleet.bench.transport import make_transport
from chatfleet.bench.workload import Workload
from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class RunProtocol:
    url: str
    load: LoadSpec  # its level is replaced per point
    slo: SLO
    repeats: int = 1
    base_seed: int = 0
    server_kind: str = "chatfleet"
    verify_reset: bool = True
    clock_floor: float | None = None  # MHz, or a fraction (<= 1) of the max clock
    throttle_reruns: int = 1
    transport: str = "raw"
    use_gpu_telemetry: bool = True
    api_key: str | None = None  # sent as 'Authorization: Bearer ...'
    confidence: float | None = None  # judge points by intervals at this level; None: by the estimate
    extend_up_to: int = 3  # an undecided point runs up to this many times its repeats

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ConfigError("repeats must be >= 1")
        if self.throttle_reruns < 0:
            raise ConfigError("throttle_reruns must be >= 0")
        if self.confidence is not None and not 0 < self.confidence < 1:
            raise ConfigError(f"confidence must be in (0, 1), got {self.confidence:g}")
        if self.extend_up_to < 1:
            raise ConfigError(f"extend_up_to must be >= 1 (1: never extend), got {self.extend_up_to}")


@dataclass(frozen=True)
class SweepSpec:
    start: float
    max_level: float
    growth: float = 2.0
    resolution: float = 1.0  # stop bisecting when the pass/fail bracket is this narrow
    max_points: int = 12

    def __post_init__(self) -> None:
        if self.start <= 0 or self.max_level < self.start:
            raise ConfigError(f"sweep needs 0 < start <= max, got start={self.start} max={self.max_level}")
        if self.growth <= 1:
            raise ConfigError("sweep growth must be > 1")
        if self.resolution <= 0 or self.max_points < 1:
            raise ConfigError("resolution must be > 0 and max_points >= 1")


@dataclass
class RunRecord:
    level: float
    repeat: int
    seed: int
    reset: ResetCheck
    telemetry: Telemetry
    throttled: bool
    summary: RunSummary
    started_unix: float
    conversations: int
    records: list[RequestRecord] = field(default_factory=list)
    extension: bool = False  # run to decide an undecided point, beyond the repeats

    def to_dict(self, with_records: bool = True) -> dict:
        return {
            "level": self.level, "repeat": self.repeat, "seed": self.seed, "extension": self.extension,
            "reset": self.reset.to_dict(),
            "telemetry": self.telemetry.to_dict(), "throttled": self.throttled,
            "summary": self.summary.to_dict(), "started_unix": self.started_unix,
            "conversations": self.conversations,
            "records": [r.to_dict() for r in self.records] if with_records else [],
        }


@dataclass
class PointResult:
    level: float
    runs: list[RunRecord]
    passed: bool
    intervals: dict[str, Interval]  # goodput, hit_rate and each SLO target, over kept repeats
    judged: PointVerdict | None = None  # with a confidence level: intervals over the pooled requests

    @property
    def verdict(self) -> str:
        """'pass', 'fail' or 'undecided' (without a confidence level: pass or fail by the estimate)."""
        if self.judged is not None:
            return self.judged.verdict
        return "pass" if self.passed else "fail"

    @property
    def kept(self) -> list[RunRecord]:
        return [r for r in self.runs if not r.throttled] or self.runs

    def breakdown(self) -> Breakdown:
        """Hit rate and TTFT by turn and by pause over the kept repeats' requests pooled."""
        return breakdown(rec for run in self.kept for rec in run.records)

    def to_dict(self, with_records: bool = True) -> dict:
        return {"level": self.level, "passed": self.passed, "verdict": self.verdict,
                "confidence": self.judged.to_dict() if self.judged is not None else None,
                "intervals": {k: asdict(v) for k, v in self.intervals.items()},
                "breakdown": self.breakdown().to_dict(),
                "runs": [r.to_dict(with_records) for r in self.runs]}


@dataclass
class SweepResult:
    mode: str
    slo: str
    points: list[PointResult]
    knee: float | None  # highest passing load; None if even the lowest failed
    knee_reached: bool  # False: the sweep hit max_level without breaking the SLO

    def point(self, level: float) -> PointResult | None:
        return next((p for p in self.points if p.level == level), None)

    @property
    def undecided(self) -> list[float]:
        """Levels whose intervals still straddled the SLO after their extensions."""
        return [p.level for p in self.points if p.verdict == "undecided"]


class Observer:
    """Progress hooks; the CLI draws progress bars from them."""

    def run_started(self, level: float, repeat: int, seed: int, load: LoadSpec) -> None: ...

    def record_done(self, rec: RequestRecord) -> None: ...

    def run_finished(self, run: RunRecord) -> None: ...


def _point_intervals(runs: list[RunRecord], slo: SLO) -> dict[str, Interval]:
    out = {"goodput": confidence_interval([r.summary.goodput for r in runs]),
           "request_rate": confidence_interval([r.summary.request_rate for r in runs])}
    hits = [r.summary.hit_rate for r in runs if r.summary.hit_rate is not None]
    if hits:
        out["hit_rate"] = confidence_interval(hits)
    for t in slo.targets:
        out[t.key] = confidence_interval([r.summary.slo_values.get(t.key, float("nan")) for r in runs])
    return out


class Bench:
    """Runs load points under the protocol against one server."""

    def __init__(self, protocol: RunProtocol, client: ClientConfig, make_workload: Callable[[int], Workload],
                 observer: Observer | None = None) -> None:
        self.p, self.client, self.make_workload = protocol, client, make_workload
        self.obs = observer or Observer()
        self.control = ServerControl(protocol.url, client.model, protocol.server_kind, headers=protocol.headers)
        self.runs_done = 0

    async def close(self) -> None:
        await self.control.close()

    async def run_once(self, level: float, repeat: int, extension: bool = False) -> RunRecord:
        seed = self.p.base_seed + 1000 * self.runs_done + 1  # a new seed for every run
        self.runs_done += 1
        load = replace(self.p.load, level=level)
        reset = await self.control.reset_verified(self.p.verify_reset)
        workload = self.make_workload(seed)
        self.obs.run_started(level, repeat, seed, load)
        sampler = TelemetrySampler(use_gpu=self.p.use_gpu_telemetry)
        transport = make_transport(self.p.transport, self.p.url, self.p.headers)
        sampler.start()
        try:
            res: LoadResult = await run_load(workload, transport, self.client, load, seed, self.obs.record_done)
        finally:
            tel = await sampler.stop()
            await transport.close()
        floor = run_floor(self.p.clock_floor, tel)
        run = RunRecord(level, repeat, seed, reset, tel, throttled(tel, floor),
                        summarize(res.records, self.p.slo, res.window_s), res.started_unix,
                        res.conversations, res.records, extension)
        self.obs.run_finished(run)
        return run

    async def run_point(self, level: float) -> PointResult:
        runs: list[RunRecord] = []
        for rep in range(self.p.repeats):
            run = await self.run_once(level, rep)
            runs.append(run)
            reruns = self.p.throttle_reruns
            while run.throttled and reruns > 0:  # set aside, and measured again
                reruns -= 1
                run = await self.run_once(level, rep)
                runs.append(run)
        kept = [r for r in runs if not r.throttled] or runs
        if self.p.confidence is None:
            iv = _point_intervals(kept, self.p.slo)
            passed = all(t.ok(iv[t.key].mean) for t in self.p.slo.targets) and all(r.summary.requests > 0 for r in kept)
            return PointResult(level, runs, passed, iv)
        judged = judge_point((rec for r in kept for rec in r.records), self.p.slo, self.p.confidence)
        extensions = 0
        while judged.verdict == "undecided" and extensions < (self.p.extend_up_to - 1) * self.p.repeats:
            runs.append(await self.run_once(level, self.p.repeats + extensions, extension=True))
            extensions += 1
            kept = [r for r in runs if not r.throttled] or runs
            judged = judge_point((rec for r in kept for rec in r.records), self.p.slo, self.p.confidence)
        passed = judged.verdict == "pass" and all(r.summary.requests > 0 for r in kept)
        return PointResult(level, runs, passed, _point_intervals(kept, self.p.slo), judged)


async def sweep(bench: Bench, spec: SweepSpec) -> SweepResult:
    """Raise the load geometrically until the SLO breaks, then bisect to ``resolution``."""
    integer = bench.p.load.mode != "open"
    points: list[PointResult] = []

    def norm(x: float) -> float:
        return float(max(1, round(x))) if integer else round(x, 6)

    async def measure(level: float) -> bool:
        done = next((p for p in points if p.level == level), None)
        if done is None:
            done = await bench.run_point(level)
            points.append(done)
        return done.passed

    lo, hi = 0.0, None
    level = norm(spec.start)
    while len(points) < spec.max_points:
        if await measure(level):
            lo = level
            if level >= spec.max_level:
                break
            nxt = norm(min(spec.max_level, level * spec.growth))
            level = nxt if nxt > level else min(spec.max_level, level + 1)
        else:
            hi = level
            break
    if hi is not None:
        while len(points) < spec.max_points and hi - lo > spec.resolution:
            mid = (lo + hi) / 2
            mid = float(math.floor(mid)) if integer else round(mid, 6)
            if mid <= lo or mid >= hi or (integer and mid < 1):
                break
            if await measure(mid):
                lo = mid
            else:
                hi = mid
    points.sort(key=lambda p: p.level)
    return SweepResult(bench.p.load.mode, str(bench.p.slo), points, lo if lo > 0 else None, hi is not None)
