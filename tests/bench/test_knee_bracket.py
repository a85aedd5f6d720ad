"""The knee's bracket, the ratio's range from two brackets, the sweep's climb past an undecided
load, and the CPU time other work takes beside a measurement."""

import asyncio
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from chatfleet.bench.demo import _print_other_work
from chatfleet.bench.knee import KneeBracket, bracket_ratio, knee_bracket
from chatfleet.bench.machine import CpuUse, CpuWatch, cpu_times, process_ticks
from chatfleet.bench.point_verdict import PointVerdict
from chatfleet.bench.report import render_html, result_document
from chatfleet.bench.sweep import PointResult, SweepSpec, sweep


def pt(level, verdict, passed=None):
    return PointResult(level, [], verdict == "pass" if passed is None else passed, {},
                       PointVerdict(verdict, {}, {}))


class ScriptedBench:
    """Just what ``sweep`` reads of a bench: each level's verdict from a table."""

    def __init__(self, verdicts):
        self.verdicts, self.measured = verdicts, []
        self.p = SimpleNamespace(load=SimpleNamespace(mode="closed"), slo="ttft_p95<=1s")
        self.measured_s = 0.0

    async def run_point(self, level, max_s=None):
        self.measured.append(level)
        self.measured_s += 10
        return pt(level, self.verdicts[level])


def run_sweep(verdicts, **kw):
    bench = ScriptedBench(verdicts)
    spec = SweepSpec(start=4, max_level=64, growth=2.0, resolution=1, **kw)
    res = asyncio.run(sweep(bench, spec))
    return bench.measured, res


def test_the_bracket_runs_from_the_knee_to_the_lowest_load_broken_above_it():
    pts = [pt(4, "pass"), pt(8, "undecided"), pt(16, "fail"), pt(6, "pass"), pt(7, "undecided"), pt(32, "fail")]
    b = knee_bracket(pts, 6)
    assert (b.met, b.broken, b.undecided) == (6, 16, (7, 8)) and (b.low, b.high) == (6, 16)
    assert b.describe() == "6-16 (met at 6, undecided at 7, 8, broken at 16)"
    assert b.to_dict()["high"] == 16
    # Nothing above the knee broke: open above; no load met: the bracket starts at 0.
    open_above = knee_bracket([pt(4, "pass"), pt(8, "undecided")], 4)
    assert open_above.high == float("inf") and open_above.to_dict()["high"] is None
    assert "open above" in open_above.describe()
    none_met = knee_bracket([pt(2, "undecided"), pt(4, "fail")], None)
    assert (none_met.low, none_met.high, none_met.undecided) == (0.0, 4, (2,))
    # A point met by its intervals whose run had no requests is not met: undecided, not broken.
    assert knee_bracket([pt(4, "pass"), pt(6, "pass", passed=False), pt(8, "fail")], 4).undecided == (6,)


def test_the_ratio_range_runs_between_the_brackets_opposite_ends():
    r = bracket_ratio(KneeBracket(8, 12, (10,)), KneeBracket(4, 5))
    assert r.value == 2 and r.low == pytest.approx(8 / 5) and r.high == 3
    assert r.holds(1.75) and r.holds(3.0) and not r.holds(1.5) and not r.holds(3.01)
    assert "2.00x (range 1.60x-3.00x from the knees' brackets)" in r.describe("from the knees' brackets")
    # Stock's bracket open above leaves the range open below; tuned's open above, open above.
    assert bracket_ratio(KneeBracket(8, 9), KneeBracket(4, None)).low == 0
    assert bracket_ratio(KneeBracket(8, None), KneeBracket(4, 5)).high == float("inf")
    assert bracket_ratio(KneeBracket(None, 4), KneeBracket(4, 5)) is None
    assert bracket_ratio(KneeBracket(8, 9), KneeBracket(None, 2)) is None


def test_the_climb_goes_on_past_an_undecided_load_until_one_breaks():
    verdicts = {4: "pass", 8: "undecided", 16: "fail", 6: "pass", 7: "undecided", 5: "pass", 12: "fail",
                10: "undecided", 11: "fail", 9: "fail"}
    measured, res = run_sweep(verdicts, probe_past_undecided=True)
    # 16 bounds the bracket; then each step bisects the wider gap (relative to its lower end):
    # 4..8 (6 met), 8..16 (12 broken), 8..12 (10 undecided), 6..8 (7 undecided), 10..12 (11 broken).
    assert measured == [4, 8, 16, 6, 12, 10, 7, 11] and res.knee == 6
    b = knee_bracket(res.points, res.knee)
    assert (b.met, b.broken, b.undecided) == (6, 11, (7, 8, 10))
    # Without the probe the sweep bisects below the undecided load and leaves the bracket open above.
    measured, res = run_sweep(verdicts)
    assert measured == [4, 8, 6, 7] and res.knee == 6 and knee_bracket(res.points, res.knee).broken is None
    # The point budget ends the narrowing: 8..16 first (ties go to the knee's side), then 16..32.
    measured, res = run_sweep({4: "pass", 8: "pass", 16: "undecided", 32: "fail", 12: "pass", 24: "fail"},
                              probe_past_undecided=True, max_points=6)
    assert measured == [4, 8, 16, 32, 12, 24] and res.knee == 12
    assert knee_bracket(res.points, res.knee).describe() == "12-24 (met at 12, undecided at 16, broken at 24)"
    # A load met above an undecided one raises the knee, and the climb goes on from there.
    measured, res = run_sweep({4: "pass", 8: "undecided", 16: "pass", 32: "fail", 24: "fail", 20: "pass",
                               22: "pass", 23: "pass"}, probe_past_undecided=True, max_points=6)
    assert measured == [4, 8, 16, 32, 24, 20] and res.knee == 20
    assert knee_bracket(res.points, res.knee).broken == 24
    # Met inside the upper gap: the knee rises past the undecided band.
    measured, res = run_sweep({4: "pass", 8: "undecided", 16: "fail", 6: "pass", 12: "pass", 14: "fail",
                               13: "fail", 7: "pass"}, probe_past_undecided=True)
    assert res.knee == 12 and knee_bracket(res.points, res.knee).broken == 13 and measured[:5] == [4, 8, 16, 6, 12]


def test_cpu_figures_are_read_from_proc_texts():
    stat = "cpu  100 20 30 400 5 6 7 8 0 0\ncpu0 50 10 15 200 2 3 3 4 0 0\n"
    assert cpu_times(stat) == (100 + 20 + 30 + 6 + 7, 20, 8)
    line = "1234 (python (x) y) S 99 1234 1234 0 -1 4194560 1 2 3 4 150 25 7 8 20 5 3 0 1 2 3"
    assert process_ticks(line) == (1234, 99, 175, 5)


def test_the_watch_counts_a_child_as_ours_and_flags_other_work():
    burn = ("import time\nwhile time.process_time() < 0.4: pass\nprint('done', flush=True)\n"
            "import sys\nsys.stdin.read()")
    watch = CpuWatch(interval_s=0.1).start()
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"
        use = watch.stop()  # the child is still alive: all its CPU time was seen
    finally:
        child.communicate("")
    assert use.ours_s >= 0.35 and use.cpus >= 1 and use.seconds > 0
    quiet = CpuUse(100, 2, 150, 10, 0, 0)
    niced = CpuUse(100, 2, 150, 60, 50, 0)  # 30% of the CPUs, all but 5% of them niced: not flagged
    busy = CpuUse(100, 2, 120, 30, 10, 5)
    assert not quiet.disturbed and not niced.disturbed and busy.disturbed
    assert busy.others_share == pytest.approx(0.175) and busy.contending_share == pytest.approx(0.125)
    assert niced.describe() == "30% of the 2 CPUs over 100 s (25% niced, 5% at normal priority)"
    assert busy.describe() == "18% of the 2 CPUs over 100 s (5% niced, 12% at normal priority, steal 5 s)"
    con = Console(record=True, width=400)
    assert _print_other_work({"stock": quiet, "tuned": niced}, con) is False
    assert "quiet (under 10% at normal priority)" in con.export_text()
    con = Console(record=True, width=400)
    assert _print_other_work({"stock": busy, "tuned": quiet}, con) is True
    text = con.export_text()
    assert "DISTURBED" in text and "during stock (" in text and "does not cover" in text
    doc = result_document("demo", {}, {}, {"machine": {"cpu_model": "x", "logical_cpus": 2, "load_average": [1, 1, 1],
                                                       "other_work": {"stock": busy.to_dict()}, "disturbed": True}})
    assert "DISTURBED" in render_html(json.loads(json.dumps(doc)))
