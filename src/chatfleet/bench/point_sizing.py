"""How long a load point measures: long enough for its interval rule to be able to decide it.

A percentile's interval (``quantile_ci``) stays open above until the sample holds
``values_needed(q, level)`` values (72 for a p95 at 95%): before that no point can be shown to
meet the SLO, however fast the server. And with them, a point decides only once its interval's
rank clears the target: ``values_to_decide`` projects, from the share of the point's values within
the target so far, how many values that takes (a share of 0.99 shows a p95 met at 142 values, 0.97
at 515; a share of 0.8 shows it broken at 11). So a point's first run lasts the load's own duration
(enough to show a clearly broken point), and while it is undecided each later run is sized, at the
rate its runs so far delivered each target's values, to reach the larger of those counts; a point
whose projection cannot be reached within its cap on measured seconds (a share close to the
percentile: a point near its knee) stops there, undecided, instead of spending the cap.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from chatfleet.bench.point_verdict import PointVerdict
from chatfleet.bench.quantile_ci import values_needed, values_to_decide
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import SLO, SLOTarget
from chatfleet.bench.stats import latency_series
from chatfleet.errors import ConfigError

MARGIN = 1.2  # aim past the count: a closed loop's request count in a window varies run to run


def target_values_needed(target: SLOTarget, level: float) -> int:
    """The fewest values of ``target``'s metric whose ``level`` interval is bounded on both sides:
    ``values_needed`` for a percentile below 100, two for a mean, one for a max (or p100)."""
    if target.stat == "mean":
        return 2
    if target.stat == "max" or float(target.stat[1:]) >= 100:
        return 1
    return values_needed(float(target.stat[1:]) / 100, level)


def values_needed_for(slo: SLO, level: float) -> dict[str, int]:
    """Target key -> the values its interval needs before it can show the target met."""
    return {t.key: target_values_needed(t, level) for t in slo.targets}


def target_values_to_decide(target: SLOTarget, values: np.ndarray, level: float) -> int | None:
    """How many values of ``target``'s metric would decide it, if more values look like ``values``:
    below the interval's own need, the projection only where it is smaller (a point leaning
    broken); from that need on, the projection (None: none within reach)."""
    need = target_values_needed(target, level)
    n = int(values.size)
    if target.stat == "mean":
        finite = values[np.isfinite(values)]
        if n < need or finite.size < n:
            return need if n < need else None
        est, sd = float(values.mean()), float(values.std(ddof=1))
        gap = abs(target.threshold_s - est)
        z = 1.96 if level == 0.95 else 2.58
        return None if gap == 0 else max(need, math.ceil((z * sd / gap) ** 2))
    if need <= 1:
        return need
    share = float(np.mean([target.ok(float(v)) for v in values])) if n else 1.0
    projected = values_to_decide(float(target.stat[1:]) / 100, share, level)
    if n < need:
        return projected if projected is not None and projected < need else need
    return projected


def values_to_decide_point(records: Iterable[RequestRecord], slo: SLO, judged: PointVerdict,
                           level: float) -> dict[str, int | None]:
    """Each undecided target of a point -> the values that would decide it (``target_values_to_decide``)."""
    series = latency_series(list(records))
    return {t.key: target_values_to_decide(t, series[t.metric], level)
            for t in slo.targets if judged.targets.get(t.key) == "undecided"}


@dataclass(frozen=True)
class PointSizing:
    """The bounds of a sized point: runs at least ``base_s`` long, at most ``max_run_s``, and at
    most ``max_point_s`` measured seconds over all of the point's runs."""

    base_s: float
    max_run_s: float
    max_point_s: float

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_run_s or self.max_point_s < self.base_s:
            raise ConfigError(f"point sizing needs 0 < base ({self.base_s:g} s) <= longest run "
                              f"({self.max_run_s:g} s) and a point cap ({self.max_point_s:g} s) >= base")

    def next_run_s(self, needed: Mapping[str, int | None], have: Mapping[str, int], measured_s: float,
                   runs_left: int = 1) -> float:
        """Seconds for the next run of an undecided point that has ``have`` values per target over
        ``measured_s`` seconds and ``needed`` to decide each undecided one: the largest shortfall at
        the rate seen so far (with ``MARGIN``), spread over ``runs_left`` runs, within [base_s,
        max_run_s] and what is left of ``max_point_s``. 0.0: no further run, because the cap is
        spent or a target cannot be decided within it (its count is None, or the rate seen so far
        would not reach it in time)."""
        left = self.max_point_s - measured_s
        if left < self.base_s or any(n is None for n in needed.values()):
            return 0.0
        want = 0.0
        for key, need in needed.items():
            got = have.get(key, 0)
            if need is None or got >= need:
                continue
            if got == 0 or measured_s <= 0:  # no rate to go by: as long as allowed
                return min(self.max_run_s, left)
            if (need - got) * measured_s / got > left:  # out of reach at this rate
                return 0.0
            want = max(want, (need - got) * MARGIN * measured_s / got / max(1, runs_left))
        return min(max(want, self.base_s), self.max_run_s, left)
