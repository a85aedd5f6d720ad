"""How far a knee is known: its bracket, its spread over repeats, and the ratio of two knees.

The bracket (``knee_bracket``): a sweep's knee is the highest load shown to meet the SLO; the
lowest load above it shown to break it bounds the knee from above, and the loads between them
whose intervals straddled the SLO, or whose runs judged alone disagreed with the pooled verdict
(``run_agreement``), are an undecided band. The ratio of two knees gets its range from the two
brackets (``bracket_ratio``).

The spread over repeats (``knee_spread``): judging a sweep's points by one repeat at a time gives
one knee per repeat (the highest load that, with every lower load measured, met the SLO in that
repeat); their range is how far one repeat alone would have put it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from chatfleet.bench.sweep import PointResult


@dataclass(frozen=True)
class KneeSpread:
    knees: tuple[float | None, ...]  # one per repeat index; None: that repeat failed the lowest load

    @property
    def low(self) -> float | None:
        vals = [k if k is not None else 0.0 for k in self.knees]
        return min(vals) if vals else None

    @property
    def high(self) -> float | None:
        vals = [k if k is not None else 0.0 for k in self.knees]
        return max(vals) if vals else None

    def describe(self) -> str:
        if not self.knees:
            return "-"
        if len(self.knees) == 1:
            return "one repeat"
        return f"{self.low:g}-{self.high:g} over {len(self.knees)} repeats"

    def to_dict(self) -> dict:
        return {**asdict(self), "low": self.low, "high": self.high}


def knee_spread(points: Sequence[PointResult]) -> KneeSpread:
    """Per-repeat knees over ``points`` (each repeat judged by its own run's SLO check)."""
    pts = sorted(points, key=lambda p: p.level)
    repeats = min((len(p.kept) for p in pts), default=0)
    knees: list[float | None] = []
    for i in range(repeats):
        knee = None
        for p in pts:
            if not p.kept[i].summary.slo_passed:
                break
            knee = p.level
        knees.append(knee)
    return KneeSpread(tuple(knees))


@dataclass(frozen=True)
class KneeRatio:
    """``value`` = top's knee / bottom's knee; ``low``-``high`` the range around it from the knees'
    brackets (``bracket_ratio``); ``high`` is infinite where the range is open above."""

    value: float
    low: float
    high: float

    def holds(self, value: float) -> bool:
        """Whether another run's ratio lies within this one's stated range."""
        return self.low <= value <= self.high

    def describe(self, over: str = "from the knees' brackets") -> str:
        high = "unbounded" if self.high == float("inf") else f"{self.high:.2f}x"
        return f"{self.value:.2f}x (range {self.low:.2f}x-{high} {over})"

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": None if self.high == float("inf") else self.high}


@dataclass(frozen=True)
class KneeBracket:
    """Where a sweep's SLO breaks: between ``met`` (its knee: the highest load shown to meet the
    SLO, every lower load measured met) and ``broken`` (the lowest load above it shown to break it),
    with the loads between them whose intervals straddled the SLO or whose runs disagreed (``undecided``).

    Each end is a point verdict at the sweep's confidence level that none of the point's runs alone
    contradicts, so (as long as the percentiles grow with the load) the load at which the SLO's
    percentile crosses its target lies in
    [``low``, ``high``]: ``low`` is 0 where no load met the SLO, ``high`` infinite where none broke it."""

    met: float | None
    broken: float | None
    undecided: tuple[float, ...] = ()

    @property
    def low(self) -> float:
        return self.met if self.met is not None else 0.0

    @property
    def high(self) -> float:
        return self.broken if self.broken is not None else float("inf")

    def describe(self) -> str:
        parts = [f"met at {self.met:g}" if self.met is not None else "no load met"]
        if self.undecided:
            parts.append("undecided at " + ", ".join(f"{u:g}" for u in self.undecided))
        parts.append(f"broken at {self.broken:g}" if self.broken is not None else "none measured broken")
        if self.met is None and self.broken is None:
            return ", ".join(parts)
        high = "open above" if self.broken is None else f"{self.high:g}"
        return f"{self.low:g}-{high} ({', '.join(parts)})"

    def to_dict(self) -> dict:
        return {"met": self.met, "broken": self.broken, "undecided": list(self.undecided), "low": self.low,
                "high": None if self.broken is None else self.high}


def _state(p: PointResult) -> str:
    if p.passed:
        return "pass"
    return "undecided" if p.verdict == "pass" else p.verdict  # met by its intervals but a run had no requests


def knee_bracket(points: Sequence[PointResult], knee: float | None) -> KneeBracket:
    """The bracket around ``knee`` (the sweep's) from the verdicts of the ``points`` above it."""
    above = sorted((p for p in points if knee is None or p.level > knee), key=lambda p: p.level)
    broken = next((p.level for p in above if _state(p) == "fail"), None)
    undecided = tuple(p.level for p in above
                      if _state(p) == "undecided" and (broken is None or p.level < broken))
    return KneeBracket(knee, broken, undecided)


def bracket_ratio(top: KneeBracket, bottom: KneeBracket) -> KneeRatio | None:
    """``top``'s knee over ``bottom``'s, with the range their brackets allow (top's low end over
    bottom's high end, and the other way round); None where either knee is missing."""
    if not top.met or not bottom.met:
        return None
    low = top.low / bottom.high  # 0 where nothing broke the bottom series
    high = top.high / bottom.low
    return KneeRatio(top.met / bottom.met, low, high)
