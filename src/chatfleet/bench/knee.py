"""The knee's spread over repeats: how far one repeat alone would have put it.

A sweep judges each load point by the mean over its repeats. Judging the same points by one
repeat at a time gives one knee per repeat (the highest load that, with every lower load
measured, met the SLO in that repeat); their range is the spread reported beside the knee.
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
    """``value`` = top's knee / bottom's knee; ``low``-``high`` from their per-repeat spreads
    (``high`` is infinite where a repeat of the bottom series met no load at all)."""

    value: float
    low: float
    high: float

    def holds(self, value: float) -> bool:
        """Whether another run's ratio lies within this one's stated range."""
        return self.low <= value <= self.high

    def describe(self) -> str:
        high = "unbounded" if self.high == float("inf") else f"{self.high:.2f}x"
        return f"{self.value:.2f}x (range {self.low:.2f}x-{high} over the knees' spreads)"

    def to_dict(self) -> dict:
        return {"value": self.value, "low": self.low, "high": None if self.high == float("inf") else self.high}


def knee_ratio(top_knee: float | None, top: KneeSpread, bottom_knee: float | None,
               bottom: KneeSpread) -> KneeRatio | None:
    """The ratio of two knees with its range; None where either knee is missing."""
    if not top_knee or not bottom_knee:
        return None
    top_low = top.low if top.low is not None else top_knee
    top_high = top.high if top.high is not None else top_knee
    bottom_low = bottom.low if bottom.low is not None else bottom_knee
    bottom_high = bottom.high if bottom.high is not None else bottom_knee
    # the range covers the knees' own ratio even where a spread's repeats all fell to one side of it
    low = min(top_low / bottom_high, top_knee / bottom_knee)
    high = max(top_high / bottom_low if bottom_low > 0 else float("inf"), top_knee / bottom_knee)
    return KneeRatio(top_knee / bottom_knee, low, high)
