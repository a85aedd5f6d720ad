"""A load point's verdict against the SLO, with how sure it is: pass, fail or undecided.

Each target's statistic is taken over the point's requests pooled (its kept runs) with a
confidence interval (``quantile_ci``). A target passes only where the whole interval meets it,
fails only where the whole interval breaks it, and is undecided otherwise; a point passes when
every target passes, fails when one fails, and is undecided otherwise. The sweep also judges each
of a point's runs alone and overrules a pooled verdict that a run contradicts (``run_agreement``);
it measures an undecided point again (bounded) and never calls a knee on one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from chatfleet.bench.quantile_ci import StatInterval, stat_interval, values_needed
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import SLO, SLOTarget
from chatfleet.bench.stats import latency_series

VERDICTS = ("pass", "fail", "undecided")


def target_verdict(target: SLOTarget, iv: StatInterval) -> str:
    """'pass' if the interval lies within the target, 'fail' if it lies beyond, else 'undecided'."""
    if iv.n == 0:  # no gaps at all (one-token replies) meet any ITL target, as in ``summarize``
        return "pass" if target.metric == "itl" else "fail"
    if target.ok(iv.high):
        return "pass"
    if not target.ok(iv.low):
        return "fail"
    return "undecided"


@dataclass(frozen=True)
class PointVerdict:
    verdict: str  # one of VERDICTS
    intervals: dict[str, StatInterval]  # target key -> its interval over the pooled requests
    targets: dict[str, str]  # target key -> its own verdict
    pooled: str | None = None  # with ``runs``: the pooled verdict, before the runs alone could overrule it
    runs: tuple[PointVerdict, ...] = ()  # each kept run judged on its own requests (``run_agreement``)

    def to_dict(self) -> dict:
        out: dict = {"verdict": self.verdict, "targets": dict(self.targets),
                     "intervals": {k: iv.to_dict() for k, iv in self.intervals.items()}}
        if self.runs:
            out |= {"pooled": self.pooled, "runs": [r.to_dict() for r in self.runs]}
        return out


def judge_point(records: Iterable[RequestRecord], slo: SLO, level: float = 0.95) -> PointVerdict:
    """The verdict over ``records`` (a point's kept runs pooled) at confidence ``level``."""
    recs = list(records)
    series = latency_series(recs)
    ivs = {t.key: stat_interval(series[t.metric], t.stat, level) for t in slo.targets}
    per = {t.key: target_verdict(t, ivs[t.key]) for t in slo.targets}
    if not any(not r.warmup for r in recs):
        verdict = "fail"
    elif any(v == "fail" for v in per.values()):
        verdict = "fail"
    elif all(v == "pass" for v in per.values()):
        verdict = "pass"
    else:
        verdict = "undecided"
    return PointVerdict(verdict, ivs, per)


def why_undecided(target: SLOTarget, iv: StatInterval, more: str = "raise --duration") -> str:
    """One line for the console: the interval that straddles the target and what would decide it
    (``more``: how to measure more)."""
    def s(v: float) -> str:
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return f"{v * 1e3:.0f} ms" if v < 1 else f"{v:.2f} s"

    text = f"{target.key} {s(iv.estimate)}, {iv.level:.0%} interval [{s(iv.low)}, {s(iv.high)}] over {iv.n} values " \
           f"straddles {s(target.threshold_s)}"
    if target.stat.startswith("p") and math.isinf(iv.high):
        need = values_needed(float(target.stat[1:]) / 100, iv.level)
        text += f"; a bound above needs >= {need} values ({more})"
    return text
