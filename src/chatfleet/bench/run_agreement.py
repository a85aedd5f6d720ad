"""Whether a point's runs agree with its pooled verdict: a point whose runs disagree is not decided.

The pooled intervals (``point_verdict.judge_point``) treat a point's requests as independent, but
the requests of one run share its chats and their histories, so one run's percentile can differ
from the next run's at the same load by more than the pooled interval allows (per-run p95s 2-5x
apart were measured). So each kept run is also judged on its own requests, by the same interval
rule (a run alone may stay undecided for lack of values), and the point is

- met only where the pooled verdict is met and no run alone is shown broken,
- broken only where the pooled verdict is broken and no run alone is shown met,
- undecided otherwise; where the pooled verdict was decided, or runs alone were shown both met and
  broken, the reason is that the runs disagree (``RUNS_DISAGREE``).

A point whose runs disagree stays so however long it is measured further (a run's own verdict
never changes, and the pooled verdict would have to cross the whole target), so the sweep does not
measure it again.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from chatfleet.bench.point_verdict import PointVerdict, judge_point
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import SLO

RUNS_DISAGREE = "runs disagree"
_WORDS = {"pass": "met", "fail": "broken", "undecided": "undecided"}


def agreed_verdict(pooled: str, runs: Sequence[str]) -> str:
    """The point's verdict from its pooled verdict and each run's own (see the module's rule)."""
    if pooled == "pass" and "fail" not in runs:
        return "pass"
    if pooled == "fail" and "pass" not in runs:
        return "fail"
    return "undecided"


def disagree(pooled: str, runs: Sequence[str]) -> bool:
    """Whether a run alone contradicts the pooled verdict, or runs alone contradict each other."""
    shown = set(runs) - {"undecided"}
    return len(shown) > 1 or (pooled != "undecided" and bool(shown - {pooled}))


def judge_runs(runs: Sequence[Sequence[RequestRecord]], slo: SLO, level: float = 0.95) -> PointVerdict:
    """The pooled verdict over ``runs`` (a point's kept runs, each its requests), overruled to
    undecided where the runs judged alone disagree with it; ``runs`` and ``pooled`` of the result
    keep each run's own verdict and the pooled one."""
    pooled = judge_point(itertools.chain.from_iterable(runs), slo, level)
    own = tuple(judge_point(r, slo, level) for r in runs)
    return replace(pooled, verdict=agreed_verdict(pooled.verdict, [v.verdict for v in own]),
                   pooled=pooled.verdict, runs=own)


def runs_disagree(judged: PointVerdict) -> bool:
    """Whether ``judged`` (from ``judge_runs``) is undecided because its runs disagree."""
    return disagreement(judged.verdict, judged.pooled, [r.verdict for r in judged.runs]) is not None


def disagreement(verdict: str, pooled: str | None, runs: Sequence[str]) -> str | None:
    """Why a point with this verdict, pooled verdict and runs' own verdicts is undecided where its
    runs disagree (``why_runs_disagree``); None where that is not why (the console reads a
    ``PointVerdict``, the report its JSON)."""
    if verdict != "undecided" or not disagree(pooled or verdict, runs):
        return None
    return why_runs_disagree(pooled or verdict, runs)


def why_runs_disagree(pooled: str, runs: Sequence[str]) -> str:
    """One line for the console and the report: the pooled verdict and each run's own."""
    alone = ", ".join(f"run {i} {_WORDS[v]}" for i, v in enumerate(runs, 1))
    return f"{RUNS_DISAGREE}: pooled {_WORDS[pooled]}, each run on its own requests: {alone}"
