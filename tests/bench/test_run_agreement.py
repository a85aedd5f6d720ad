"""A point whose runs disagree is not decided: each run judged on its own requests can overrule the
pooled verdict (``run_agreement``), and the sweep's point, knee, bracket and ratio follow it."""

import asyncio
import json
from types import SimpleNamespace

import pytest

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.console import undecided_lines
from chatfleet.bench.demo import why_no_knee
from chatfleet.bench.knee import KneeBracket, bracket_ratio, knee_bracket
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.point_sizing import PointSizing
from chatfleet.bench.point_verdict import judge_point
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.report import render_html, result_document, sweep_to_dict
from chatfleet.bench.run_agreement import agreed_verdict, disagree, judge_runs, runs_disagree
from chatfleet.bench.server_ops import ResetCheck
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.stats import summarize
from chatfleet.bench.sweep import (
    Bench,
    PointResult,
    RunProtocol,
    RunRecord,
    SweepResult,
    SweepSpec,
    _point_intervals,
    sweep,
)
from chatfleet.bench.telemetry import ClockSample, Telemetry

SLO = parse_slo("ttft_p95<=1s")


def recs(n, slow=0, fast_s=0.1, slow_s=2.0):
    """n requests, the last ``slow`` of them over the 1 s target."""
    return [RequestRecord(conv_id=i, turn=0, character_id=0, slot=0, intended_s=0.0,
                          ttft_s=slow_s if i >= n - slow else fast_s, reply_s=3.0, itl_s=[0.01])
            for i in range(n)]


MET = recs(1000)  # shown met alone (a p95 needs 72 values to be bounded above)
FEW_FAST = recs(20)  # undecided alone: too few values to show a p95 met
FEW_SLOW = recs(20, slow=6)  # shown broken alone: 30% of its values over the target
BROKEN = recs(200, slow=100)


def test_the_rule_over_the_pooled_verdict_and_each_runs_own():
    assert agreed_verdict("pass", ["pass", "undecided"]) == "pass"
    assert agreed_verdict("pass", ["pass", "fail"]) == "undecided"
    assert agreed_verdict("fail", ["fail", "undecided"]) == "fail"
    assert agreed_verdict("fail", ["pass", "fail"]) == "undecided"
    assert agreed_verdict("undecided", ["pass", "pass"]) == "undecided"
    assert not disagree("pass", ["pass", "undecided"]) and not disagree("undecided", ["fail", "undecided"])
    assert disagree("pass", ["undecided", "fail"]) and disagree("fail", ["pass"])
    assert disagree("undecided", ["pass", "fail"])  # runs alone shown both ways: nothing could decide it


def test_a_point_met_pooled_but_broken_by_one_run_alone_is_undecided_with_the_reason():
    assert judge_point(MET + FEW_SLOW, SLO).verdict == "pass"  # what the pooled intervals alone said
    judged = judge_runs([MET, FEW_SLOW], SLO)
    assert (judged.verdict, judged.pooled) == ("undecided", "pass")
    assert [r.verdict for r in judged.runs] == ["pass", "fail"]
    assert judged.targets == {"ttft_p95": "pass"} and judged.intervals["ttft_p95"].n == 1020  # pooled, as before
    assert runs_disagree(judged)
    assert judged.to_dict()["pooled"] == "pass" and [r["verdict"] for r in judged.to_dict()["runs"]] == ["pass", "fail"]
    # Broken pooled, but one run alone shown met: undecided too.
    assert judge_point(BROKEN + MET[:100], SLO).verdict == "fail"
    judged = judge_runs([BROKEN, MET[:100]], SLO)
    assert judged.verdict == "undecided" and runs_disagree(judged)


def test_agreeing_runs_keep_the_pooled_verdict():
    for runs, verdict in (([MET, FEW_FAST], "pass"), ([BROKEN, FEW_SLOW], "fail"), ([BROKEN, FEW_FAST], "fail"),
                          ([FEW_FAST, FEW_FAST], "undecided"), ([MET], "pass"), ([FEW_SLOW], "fail")):
        pooled = judge_point([r for run in runs for r in run], SLO)
        judged = judge_runs(runs, SLO)
        assert judged.verdict == pooled.verdict == verdict, runs
        assert judged.intervals == pooled.intervals and not runs_disagree(judged)


def point(level, runs):
    """A judged point whose runs hold ``runs``' requests."""
    tel = Telemetry("cpuinfo", 2600.0, [ClockSample(t, 2600.0) for t in range(3)])
    records = [RunRecord(level, i, i, ResetCheck("chatfleet", "usage", 10, 0, ""), tel, False,
                         summarize(r, SLO, 10.0), 0.0, int(level), r) for i, r in enumerate(runs)]
    judged = judge_runs(runs, SLO)
    return PointResult(level, records, judged.verdict == "pass", _point_intervals(records, SLO), judged)


# Stock's loads: 4 met in both runs, 5 met pooled but broken in its second run alone, 6 and up broken.
STOCK = {4: [MET, FEW_FAST], 5: [MET, FEW_SLOW], 6: [BROKEN, FEW_SLOW], 8: [BROKEN, BROKEN]}


class ScriptedBench:
    """Just what ``sweep`` reads of a bench: each level's point judged from its scripted runs."""

    def __init__(self, levels):
        self.levels, self.measured, self.measured_s = levels, [], 0.0
        self.p = SimpleNamespace(load=SimpleNamespace(mode="closed"), slo=SLO)

    async def run_point(self, level, max_s=None):
        self.measured.append(level)
        self.measured_s += 10
        return point(level, self.levels[level])


def test_the_sweep_knee_bracket_and_ratio_treat_a_disagreeing_point_as_undecided():
    bench = ScriptedBench(STOCK)
    res = asyncio.run(sweep(bench, SweepSpec(4, 64, probe_past_undecided=True)))
    # 4 met, 8 broken, then bisection: 6 broken, 5 undecided (its runs disagree): the knee stays at 4.
    assert bench.measured == [4, 8, 6, 5] and res.knee == 4 and res.undecided == [5]
    bracket = knee_bracket(res.points, res.knee)
    assert (bracket.met, bracket.broken, bracket.undecided) == (4, 6, (5,))
    assert bracket.describe() == "4-6 (met at 4, undecided at 5, broken at 6)"
    # Judged by the pooled intervals alone, 5 was met: knee 5, bracket 5-6.
    pooled_only = KneeBracket(5, 6)
    tuned = KneeBracket(16, 20)
    before, after = bracket_ratio(tuned, pooled_only), bracket_ratio(tuned, bracket)
    assert before.value == pytest.approx(3.2) and (before.low, before.high) == pytest.approx((16 / 6, 4.0))
    assert after.value == 4 and (after.low, after.high) == pytest.approx((16 / 6, 5.0))
    assert after.low <= before.low and after.high > before.high  # the range widens
    # The console and the report say why 5 is undecided.
    (line,) = undecided_lines(res, "raise --max-point")
    assert line == ("load 5 undecided after 2 runs: runs disagree: pooled met, each run on its own requests: "
                    "run 1 met, run 2 broken")
    doc = json.loads(json.dumps(result_document("sweep", {}, {"stock": sweep_to_dict(res)})))
    assert "runs disagree: pooled met" in render_html(doc)
    # A series whose lowest load's runs disagree has no knee, and says why.
    lone = SweepResult("closed", str(SLO), [point(5, STOCK[5])], None, True)
    assert "stayed undecided after 2 runs: runs disagree" in why_no_knee(lone)


class RecordedBench(Bench):
    """A bench whose runs return scripted requests instead of measuring a server."""

    def __init__(self, runs, **protocol):
        proto = RunProtocol("http://127.0.0.1:9", LoadSpec("closed", 1, duration_s=8, warmup_s=0), SLO,
                            confidence=0.95, sizing=PointSizing(8, 60, 240), **protocol)
        super().__init__(proto, ClientConfig(model="m"), lambda seed: None)
        self.scripted = list(runs)

    async def run_once(self, level, repeat, extension=False, duration_s=None):
        r = self.scripted.pop(0)
        self.measured_s += duration_s or 8
        tel = Telemetry("cpuinfo", 2600.0, [ClockSample(t, 2600.0) for t in range(3)])
        return RunRecord(level, repeat, repeat, ResetCheck("chatfleet", "usage", 10, 0, ""), tel, False,
                         summarize(r, SLO, duration_s or 8), 0.0, int(level), r, extension)


def test_a_point_whose_runs_disagree_is_not_measured_again():
    bench = RecordedBench([MET, FEW_SLOW] + [MET] * 4, repeats=2, extend_up_to=3)
    pt = asyncio.run(bench.run_point(5))
    # Without the rule this point was met; with it, undecided, and no run past its repeats is spent on it.
    assert pt.verdict == "undecided" and not pt.passed and len(pt.runs) == 2 and runs_disagree(pt.judged)
    # Runs that agree but cannot decide the point yet still get their extensions (within the caps),
    # until their pooled 80 values show it met.
    bench = RecordedBench([FEW_FAST, FEW_FAST] + [FEW_FAST] * 10, repeats=2, extend_up_to=3)
    pt = asyncio.run(bench.run_point(5))
    assert len(pt.runs) == 4 and bench.measured_s <= 240 and pt.verdict == "pass"
    # And agreeing runs keep the pooled verdict.
    bench = RecordedBench([MET, FEW_FAST], repeats=2)
    assert asyncio.run(bench.run_point(5)).verdict == "pass"
