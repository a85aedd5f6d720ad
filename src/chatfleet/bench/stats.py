"""Per-run statistics: percentiles, SLO attainment, goodput, prefix-cache hit rate by turn and pause."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from chatfleet.bench.breakdown import Breakdown, breakdown
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import SLO, stat_of

STATS = ("p50", "p90", "p95", "p99", "mean", "max")
# Two-sided 95% Student t quantiles by degrees of freedom (beyond the table: normal 1.96).
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int


def confidence_interval(values: list[float], level: float = 0.95,
                        within: tuple[float, float] = (-math.inf, math.inf)) -> Interval:
    """Student-t interval of the mean (95%); a single value gives a zero-width interval.

    ``within``: the range the quantity can take (a rate or a latency is never negative, a hit
    rate at most 1); the interval is cut to it, since a t interval on two or three repeats can
    reach past it, and no mean outside it is possible."""
    arr = np.asarray([v for v in values if v == v and math.isfinite(v)], dtype=float)
    if arr.size == 0:
        return Interval(float("nan"), float("nan"), float("nan"), 0)
    m = float(arr.mean())
    if arr.size == 1:
        return Interval(m, m, m, 1)
    df = arr.size - 1
    t = next((v for k, v in sorted(_T95.items()) if k >= df), 1.96) if level == 0.95 else 1.96
    half = t * float(arr.std(ddof=1)) / math.sqrt(arr.size)
    low, high = within
    return Interval(m, max(m - half, low), min(m + half, high), int(arr.size))


@dataclass(frozen=True)
class TurnHits:
    requests: int
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class RunSummary:
    window_s: float
    requests: int
    ok: int
    errors: int
    rate_limited: int
    timeouts: int
    latency: dict[str, dict[str, float]]  # metric -> stat -> seconds
    request_rate: float  # finished ok requests / s
    output_tokens_per_s: float
    goodput: float  # requests / s that met every SLO target
    slo_attainment: float  # share of requests that met every target
    slo_passed: bool
    slo_values: dict[str, float]  # target key -> measured value
    hit_rate: float | None
    hits_by_turn: dict[int, TurnHits] = field(default_factory=dict)
    breakdown: Breakdown = field(default_factory=lambda: Breakdown([], []))  # by turn and by pause

    def to_dict(self) -> dict:
        d = asdict(self)
        d["breakdown"] = self.breakdown.to_dict()
        d["hits_by_turn"] = {
            str(k): {**asdict(v), "hit_rate": v.hit_rate} for k, v in self.hits_by_turn.items()
        }
        return d


def hits_by_turn(records: list[RequestRecord]) -> dict[int, TurnHits]:
    acc: dict[int, list[int]] = {}
    for r in records:
        if r.status != "ok" or r.prompt_tokens is None or r.cached_tokens is None:
            continue
        a = acc.setdefault(r.turn, [0, 0, 0])
        a[0] += 1
        a[1] += r.prompt_tokens
        a[2] += r.cached_tokens
    return {t: TurnHits(*acc[t]) for t in sorted(acc)}


def latency_series(records: list[RequestRecord]) -> dict[str, np.ndarray]:
    """Each SLO metric's values over measured ``records`` (warmup excluded), as arrays once (a long
    run has millions of inter-token gaps). A failed request is infinitely slow for TTFT and reply."""
    recs = [r for r in records if not r.warmup]
    inf = float("inf")
    return {
        "ttft": np.asarray([r.ttft_s if r.status == "ok" and r.ttft_s is not None else inf for r in recs], dtype=float),
        "reply": np.asarray([r.reply_s if r.status == "ok" and r.reply_s is not None else inf for r in recs],
                            dtype=float),
        "queue": np.asarray([r.queue_s for r in recs if r.queue_s is not None], dtype=float),
        "itl": np.fromiter(itertools.chain.from_iterable(r.itl_s for r in recs if r.status == "ok"), dtype=float),
    }


def summarize(records: list[RequestRecord], slo: SLO | None, window_s: float) -> RunSummary:
    """Stats over the measured (non-warmup) records of one run lasting ``window_s`` seconds.

    A failed request counts as infinitely slow for TTFT and reply percentiles, so errors
    cannot make a run look better than it was.
    """
    recs = [r for r in records if not r.warmup]
    ok = [r for r in recs if r.status == "ok"]
    series = latency_series(recs)
    latency = {m: {s: stat_of(v, s) for s in STATS} for m, v in series.items()}
    window = max(window_s, 1e-9)
    good = [r for r in ok if slo is None or slo.request_ok(r.slo_values())]
    slo_values: dict[str, float] = {}
    passed = bool(recs)
    if slo is not None:
        for t in slo.targets:
            v = stat_of(series[t.metric], t.stat)
            slo_values[t.key] = v
            passed = passed and (t.ok(v) or (t.metric == "itl" and not series["itl"].size and bool(ok)))
    hbt = hits_by_turn(recs)
    prompt = sum(h.prompt_tokens for h in hbt.values())
    return RunSummary(
        window_s=window_s,
        requests=len(recs),
        ok=len(ok),
        errors=sum(r.status == "error" for r in recs),
        rate_limited=sum(r.status == "rate_limited" for r in recs),
        timeouts=sum(r.status == "timeout" for r in recs),
        latency=latency,
        request_rate=len(ok) / window,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / window,
        goodput=len(good) / window,
        slo_attainment=len(good) / len(recs) if recs else 0.0,
        slo_passed=passed,
        slo_values=slo_values,
        hit_rate=sum(h.cached_tokens for h in hbt.values()) / prompt if prompt else None,
        hits_by_turn=hbt,
        breakdown=breakdown(recs),
    )
