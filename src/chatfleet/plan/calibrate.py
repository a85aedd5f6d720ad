"""Fit a GPU's efficiency factors from one measured sweep (a ``chatfleet sweep`` result file).

The measured sweep's protocol (mode, levels, run length, SLO, workload profile) is read from the
file; the serving config (model, KV pool, cap) is the one the measured engine ran with. Each
candidate ``Efficiency`` is scored by simulating every measured level once and comparing, in
log space, the median and p90 inter-token latency and the median TTFT with the measured ones;
a coordinate search (factors halved and doubled, then finer steps) keeps the best. A CPU gets a
nominal catalog entry (``cpu`` in ``gpus.yaml``) whose efficiencies absorb what it really does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from chatfleet.errors import ConfigError
from chatfleet.plan.catalog import Efficiency

METRICS = (("itl", "p50"), ("itl", "p90"), ("ttft", "p50"))
FACTORS = ("compute", "memory", "step_overhead_ms")
LIMITS = {"compute": (1e-3, 1.5), "memory": (1e-3, 1.5), "step_overhead_ms": (0.0, 1e3)}


@dataclass(frozen=True)
class MeasuredSweep:
    series: str
    mode: str
    slo: str
    profile: str
    tokenizer: str | None
    duration_s: float
    warmup_s: float
    knee: float | None
    levels: tuple[float, ...]
    metrics: dict[float, dict[str, float]]  # level -> "itl_p50" ... -> seconds (mean over runs)


def read_measured(doc: dict[str, Any], series: str | None = None) -> MeasuredSweep:
    names = list(doc.get("series") or {})
    if not names:
        raise ConfigError("the result has no series")
    name = series or names[0]
    if name not in doc["series"]:
        raise ConfigError(f"no series {name!r} in the result; it has: {', '.join(names)}")
    s = doc["series"][name]
    settings = doc.get("settings") or {}
    load = (settings.get("protocol") or {}).get("load") or {}
    profile = settings.get("profile")
    profile = profile.get("name") if isinstance(profile, dict) else profile
    if not profile:
        raise ConfigError("the result does not say which workload profile it measured")
    if load.get("join", "start") != "start":
        raise ConfigError(f"the sweep joined its chats mid-conversation (join {load['join']!r}); the simulator "
                          "starts every chat at its first turn: calibrate on a sweep run with join 'start'")
    metrics: dict[float, dict[str, float]] = {}
    for p in s["points"]:
        runs = [r for r in p["runs"] if not r.get("throttled")] or p["runs"]
        vals: dict[str, float] = {}
        for metric, stat in METRICS:
            xs = [r["summary"]["latency"][metric][stat] for r in runs]
            xs = [x for x in xs if x is not None and math.isfinite(x) and x > 0]
            if xs:
                vals[f"{metric}_{stat}"] = sum(xs) / len(xs)
        metrics[float(p["level"])] = vals
    tok = settings.get("tokenizer")
    tokenizer = tok if tok and not tok.startswith("estimate") else None
    return MeasuredSweep(name, s["mode"], s["slo"], str(profile), tokenizer,
                         float(load.get("duration_s", 30.0)), float(load.get("warmup_s", 5.0)), s.get("knee"),
                         tuple(sorted(metrics)), metrics)


def score(measured: MeasuredSweep, simulated: dict[float, dict[str, float]]) -> float:
    """Mean squared log ratio simulated / measured over every level and metric both have."""
    errs = []
    for level, want in measured.metrics.items():
        got = simulated.get(level, {})
        for key, m in want.items():
            g = got.get(key)
            if g is not None and g > 0 and math.isfinite(g):
                errs.append(math.log(g / m) ** 2)
            else:
                errs.append(25.0)  # a metric the simulation could not produce: as bad as 150x off
    return sum(errs) / len(errs) if errs else math.inf


@dataclass(frozen=True)
class Fit:
    efficiency: Efficiency
    error: float  # mean squared log ratio
    evaluations: int
    simulated: dict[float, dict[str, float]]


def fit_efficiency(measured: MeasuredSweep, simulate: Callable[[Efficiency], dict[float, dict[str, float]]],
                   start: Efficiency, rounds: int = 3) -> Fit:
    cache: dict[tuple, tuple[float, dict]] = {}

    def evaluate(e: Efficiency) -> float:
        key = (round(e.compute, 6), round(e.memory, 6), round(e.step_overhead_ms, 6))
        if key not in cache:
            sim = simulate(e)
            cache[key] = (score(measured, sim), sim)
        return cache[key][0]

    best = start
    best_err = evaluate(best)
    for step in (4.0, 2.0, 1.41, 1.19)[:max(1, rounds + 1)]:
        improved = True
        while improved:
            improved = False
            for factor in FACTORS:
                for mult in (step, 1 / step):
                    lo, hi = LIMITS[factor]
                    v = getattr(best, factor)
                    new = min(hi, max(lo, (v if v > 0 else 0.1) * mult))
                    if new == v:
                        continue
                    cand = replace(best, **{factor: new})
                    err = evaluate(cand)
                    if err < best_err - 1e-9:
                        best, best_err, improved = cand, err, True
    return Fit(best, best_err, len(cache), cache[(round(best.compute, 6), round(best.memory, 6),
                                                  round(best.step_overhead_ms, 6))][1])
