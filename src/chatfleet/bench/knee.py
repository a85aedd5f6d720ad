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
