"""Run protocol and knee search.

Every run: reset the server's prefix cache and verify it, take a fresh seed, sample clocks,
warm up (excluded), measure. A load point is repeated and reported with confidence intervals;
runs under the clock floor are set aside (and rerun once). The sweep raises the load until the
SLO breaks, then bisects: the knee is the highest load that meets it.

With a ``confidence`` level a point is judged by intervals over its requests pooled
(``point_verdict``): it passes only where every target's interval meets the SLO, fails only where
one breaks it; each run is also judged alone, and a point whose runs disagree with the pooled
verdict is undecided (``run_agreement``). An undecided point is measured again, one run of the same
length at a time, up to ``extend_up_to`` times its repeats (not one whose runs disagree: no later
run undoes a run's own verdict). A knee is never called on an undecided point. With
``sizing`` (``point_sizing``) those later runs are as long as the point needs for its intervals to be
able to decide (a p95 needs 72 values before it can be bounded above), within a cap on the point's
measured seconds; a sweep's ``budget_s`` caps the measured seconds of all its points. With
``probe_past_undecided`` the climb goes on past an undecided point until a load breaks the SLO (or
one meets it again), so the knee's bracket (``knee.knee_bracket``) is bounded above, and the
bisection also narrows the gap between the undecided loads and the lowest broken one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from chatfleet.bench.breakdown import Breakdown, breakdown
from chatfleet.bench.client import ClientConfig
from chatfleet.bench.loops import LoadResult, LoadSpec, run_load
from chatfleet.bench.point_sizing import PointSizing, values_to_decide_point
from chatfleet.bench.point_verdict import PointVerdict
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.run_agreement import judge_runs, runs_disagree
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
    sizing: PointSizing | None = None  # with a confidence level: size an undecided point's later runs

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
    budget_s: float | None = None  # measured seconds over all points; None: unbounded
    probe_past_undecided: bool = False  # keep raising the load past an undecided point until one breaks

    def __post_init__(self) -> None:
        if self.budget_s is not None and self.budget_s <= 0:
            raise ConfigError(f"a sweep's time budget must be > 0 seconds, got {self.budget_s:g}")
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
    judged: PointVerdict | None = None  # with a confidence level: pooled intervals, each run judged alone

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
    knee_reached: bool  # False: the sweep stopped (max_level, max_points, budget) without breaking the SLO
    out_of_budget: bool = False  # the sweep stopped because its measured seconds were spent

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
    positive, share = (0.0, math.inf), (0.0, 1.0)
    out = {"goodput": confidence_interval([r.summary.goodput for r in runs], within=positive),
           "request_rate": confidence_interval([r.summary.request_rate for r in runs], within=positive)}
    hits = [r.summary.hit_rate for r in runs if r.summary.hit_rate is not None]
    if hits:
        out["hit_rate"] = confidence_interval(hits, within=share)
    for t in slo.targets:  # latencies, or (an attainment target) a share
        values = [r.summary.slo_values.get(t.key, float("nan")) for r in runs]
        out[t.key] = confidence_interval(values, within=positive)
    return out


class Bench:
    """Runs load points under the protocol against one server."""

    measured_s = 0.0  # measured seconds of every run so far (a sweep's budget reads it)

    def __init__(self, protocol: RunProtocol, client: ClientConfig, make_workload: Callable[[int], Workload],
                 observer: Observer | None = None) -> None:
        self.p, self.client, self.make_workload = protocol, client, make_workload
        self.obs = observer or Observer()
        self.control = ServerControl(protocol.url, client.model, protocol.server_kind, headers=protocol.headers)
        self.runs_done = 0

    async def close(self) -> None:
        await self.control.close()

    async def run_once(self, level: float, repeat: int, extension: bool = False,
                       duration_s: float | None = None) -> RunRecord:
        """One run at ``level``, ``duration_s`` measured seconds long (None: the load's own)."""
        seed = self.p.base_seed + 1000 * self.runs_done + 1  # a new seed for every run
        self.runs_done += 1
        load = replace(self.p.load, level=level, duration_s=duration_s or self.p.load.duration_s)
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
        self.measured_s += res.window_s
        self.obs.run_finished(run)
        return run

    async def _repeat(self, level: float, rep: int, runs: list[RunRecord], extension: bool = False,
                      duration_s: float | None = None) -> None:
        """One run into ``runs``; a throttled one is set aside and measured again (bounded)."""
        run = await self.run_once(level, rep, extension, duration_s)
        runs.append(run)
        reruns = self.p.throttle_reruns
        while run.throttled and reruns > 0:
            reruns -= 1
            run = await self.run_once(level, rep, extension, duration_s)
            runs.append(run)

    async def run_point(self, level: float, max_s: float | None = None) -> PointResult:
        """Measure ``level``: its repeats, then (judged by intervals) runs to decide it if undecided;
        ``max_s`` caps a sized point's measured seconds below the protocol's own cap."""
        runs: list[RunRecord] = []
        if self.p.confidence is None:
            for rep in range(self.p.repeats):
                await self._repeat(level, rep, runs)
            kept = _kept(runs)
            iv = _point_intervals(kept, self.p.slo)
            passed = all(t.ok(iv[t.key].mean) for t in self.p.slo.targets) and all(r.summary.requests > 0 for r in kept)
            return PointResult(level, runs, passed, iv)
        confidence = self.p.confidence
        sizing = self.p.sizing
        if sizing is not None and max_s is not None:
            sizing = replace(sizing, max_point_s=max(sizing.base_s, min(sizing.max_point_s, max_s)))
        def judge() -> PointVerdict:
            return judge_runs([r.records for r in _kept(runs)], self.p.slo, confidence)

        def sized(judged: PointVerdict, runs_left: int) -> float:
            """The next run's seconds for an undecided point (0.0: its cap is spent)."""
            assert sizing is not None
            kept = _kept(runs)
            needed = values_to_decide_point((rec for r in kept for rec in r.records), self.p.slo, judged, confidence)
            have = {k: iv.n for k, iv in judged.intervals.items()}
            return sizing.next_run_s(needed, have, sum(r.summary.window_s for r in kept), runs_left)

        judged: PointVerdict | None = None
        for rep in range(self.p.repeats):
            duration = None  # the first run, and the repeats of a decided point: the load's own
            if sizing is not None and judged is not None and judged.verdict == "undecided":
                duration = sized(judged, self.p.repeats - rep) or None
            await self._repeat(level, rep, runs, duration_s=duration)
            judged = judge()
        assert judged is not None  # repeats >= 1
        extensions = 0
        while (judged.verdict == "undecided" and not runs_disagree(judged)
               and extensions < (self.p.extend_up_to - 1) * self.p.repeats):
            duration = sized(judged, 1) if sizing is not None else None
            if duration == 0.0:
                break
            runs.append(await self.run_once(level, self.p.repeats + extensions, extension=True, duration_s=duration))
            extensions += 1
            judged = judge()
        kept = _kept(runs)
        passed = judged.verdict == "pass" and all(r.summary.requests > 0 for r in kept)
        return PointResult(level, runs, passed, _point_intervals(kept, self.p.slo), judged)


def _kept(runs: list[RunRecord]) -> list[RunRecord]:
    return [r for r in runs if not r.throttled] or runs


async def sweep(bench: Bench, spec: SweepSpec) -> SweepResult:
    """Raise the load geometrically until the SLO breaks, then bisect to ``resolution``; with a
    ``budget_s``, no point starts once the sweep's measured seconds are spent, and a sized point
    measures at most what is left."""
    integer = bench.p.load.mode != "open"
    points: list[PointResult] = []
    spent_before = bench.measured_s
    out_of_budget = False

    def norm(x: float) -> float:
        return float(max(1, round(x))) if integer else round(x, 6)

    def left_s() -> float | None:
        return None if spec.budget_s is None else spec.budget_s - (bench.measured_s - spent_before)

    async def measure(level: float) -> PointResult | None:
        """``level``'s point; None: the budget is spent, the sweep stops."""
        nonlocal out_of_budget
        done = next((p for p in points if p.level == level), None)
        if done is None:
            left = left_s()
            if left is not None and left <= 0:
                out_of_budget = True
                return None
            done = await bench.run_point(level, left)
            points.append(done)
        return done

    lo, hi = 0.0, None  # highest load met; lowest load above it not met
    level = norm(spec.start)
    while len(points) < spec.max_points:
        pt = await measure(level)
        if pt is None:
            break
        if pt.passed:
            lo, hi = level, None
        else:
            hi = level if hi is None else min(hi, level)
            if not (spec.probe_past_undecided and pt.verdict == "undecided"):
                break
        if level >= spec.max_level:
            break
        nxt = norm(min(spec.max_level, level * spec.growth))
        level = nxt if nxt > level else min(spec.max_level, level + 1)
    def midpoint(a: float, b: float) -> float | None:
        mid = float(math.floor((a + b) / 2)) if integer else round((a + b) / 2, 6)
        return None if mid <= a or mid >= b or (integer and mid < 1) else mid

    def upper_gap() -> tuple[float, float] | None:
        """With the probe: the gap between the highest undecided load above the knee and the lowest
        broken one above that, where it is wider than the resolution."""
        if not spec.probe_past_undecided:
            return None
        above = [p for p in points if p.level > lo]
        broken = min((p.level for p in above if p.verdict == "fail"), default=None)
        band = [p.level for p in above if not p.passed and p.verdict != "fail" and (broken is None or p.level < broken)]
        if broken is None or not band or broken - max(band) <= spec.resolution:
            return None
        return max(band), broken

    if hi is not None:
        # Bisect the gap below the lowest load not met (raising the knee) and, with the probe, the
        # gap between the undecided band and the lowest broken load (lowering the bracket's top):
        # each step the one wider relative to its lower end, as a ratio of knees reads it.
        while len(points) < spec.max_points:
            gaps = [g for g in ((lo, hi) if hi - lo > spec.resolution else None, upper_gap()) if g is not None]
            if not gaps:
                break
            a, b = max(gaps, key=lambda g: (g[1] - g[0]) / g[0] if g[0] > 0 else math.inf)
            mid = midpoint(a, b)
            if mid is None or any(p.level == mid for p in points):
                break
            pt = await measure(mid)
            if pt is None:
                break
            if mid < hi:
                if pt.passed:
                    lo = mid
                else:
                    hi = mid
            elif pt.passed:  # met above the undecided band: the knee rises there
                lo, hi = mid, min((p.level for p in points if p.level > mid and not p.passed), default=None)
                if hi is None:
                    break
    points.sort(key=lambda p: p.level)
    return SweepResult(bench.p.load.mode, str(bench.p.slo), points, lo if lo > 0 else None, hi is not None,
                       out_of_budget)
