"""How long a load point measures: long enough for its interval rule to be able to decide it.

A percentile's interval (``quantile_ci``) stays open above until the sample holds
``values_needed(q, level)`` values (72 for a p95 at 95%): before that no point can be shown to
meet the SLO, however fast the server. So a point's first run lasts the load's own duration (enough
to show a clearly broken point: its lower bound needs far fewer values), and while the point is
undecided each later run is sized, at the rate the point's runs so far delivered each target's
values, to bring every target's sample to its need. A point whose estimate already breaks a
target leans broken: showing that needs only its lower bound above the target, far fewer values,
so its next run doubles the sample instead, as does a point with its values but an interval still
straddling the target (a point near its knee, which more data decides slowly), while the point has
measured under ``max_doubling_s``. A cap on the point's measured seconds bounds it all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from chatfleet.bench.point_verdict import PointVerdict
from chatfleet.bench.quantile_ci import values_needed
from chatfleet.bench.slo import SLO, SLOTarget
from chatfleet.errors import ConfigError

MARGIN = 1.2  # aim past the need: a closed loop's request count in a window varies run to run


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


def leans_broken(slo: SLO, judged: PointVerdict) -> bool:
    """Whether an undecided point's estimate already breaks one of the targets left undecided."""
    return any(judged.targets.get(t.key) == "undecided" and not t.ok(judged.intervals[t.key].estimate)
               for t in slo.targets)


@dataclass(frozen=True)
class PointSizing:
    """The bounds of a sized point: runs at least ``base_s`` long, at most ``max_run_s``, at most
    ``max_point_s`` measured seconds over all of the point's runs, and doubling (a point leaning
    broken, or straddling with its values) only up to ``max_doubling_s`` of them (None: the cap)."""

    base_s: float
    max_run_s: float
    max_point_s: float
    max_doubling_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.max_run_s or self.max_point_s < self.base_s:
            raise ConfigError(f"point sizing needs 0 < base ({self.base_s:g} s) <= longest run "
                              f"({self.max_run_s:g} s) and a point cap ({self.max_point_s:g} s) >= base")
        if self.max_doubling_s is not None and self.max_doubling_s < self.base_s:
            raise ConfigError(f"point sizing needs the doubling cap ({self.max_doubling_s:g} s) >= base")

    def next_run_s(self, needed: Mapping[str, int], have: Mapping[str, int], measured_s: float,
                   runs_left: int = 1, leans_broken: bool = False) -> float:
        """Seconds for the next run of an undecided point that has ``have`` values per target over
        ``measured_s`` seconds: the largest shortfall at the rate seen so far (with ``MARGIN``),
        spread over ``runs_left`` runs; the point's own length again (doubling its sample) when no
        target falls short or the point ``leans_broken``; within [base_s, max_run_s] and what is
        left of ``max_point_s`` (0.0: nothing is left, no further run)."""
        left = self.max_point_s - measured_s
        if left < self.base_s:
            return 0.0
        want = 0.0
        for key, need in ({} if leans_broken else needed).items():
            got = have.get(key, 0)
            if got >= need:
                continue
            if got == 0 or measured_s <= 0:  # no rate to go by: as long as allowed
                want = math.inf
                break
            want = max(want, (need - got) * MARGIN * measured_s / got / max(1, runs_left))
        if want == 0.0:  # leaning broken, or every target has its values and still straddles
            if self.max_doubling_s is not None:
                left = min(left, self.max_doubling_s - measured_s)
                if left < self.base_s:
                    return 0.0
            want = measured_s
        return min(max(want, self.base_s), self.max_run_s, left)
