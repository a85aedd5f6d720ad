"""Sizing a load point for its SLO's percentiles: the values each target's interval needs (checked
against quantile_ci itself), the next run's length, and a sized point and a budgeted sweep run
against the scripted server."""

import asyncio
import math

import numpy as np
import pytest

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.machine import MachineInfo, cpu_model
from chatfleet.bench.point_sizing import PointSizing, leans_broken, target_values_needed, values_needed_for
from chatfleet.bench.point_verdict import judge_point
from chatfleet.bench.quantile_ci import stat_interval
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.sweep import Bench, RunProtocol, SweepSpec, sweep
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.errors import ConfigError


@pytest.mark.parametrize("stat", ["p50", "p90", "p95", "p99", "p99.9"])
@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_the_needed_count_is_the_fewest_values_whose_interval_is_bounded_on_both_sides(stat, level):
    (target,) = parse_slo(f"ttft_{stat}<=1s").targets
    need = target_values_needed(target, level)
    values = np.linspace(0.1, 0.5, need)
    iv = stat_interval(values, stat, level)
    # With the count the sizing asks for, the interval can lie within a target: bounded above and below.
    assert math.isfinite(iv.high) and math.isfinite(iv.low), (stat, level, need, iv)
    # And no fewer would do: one value less leaves it open above, so no point could be shown to meet it.
    assert stat_interval(values[:-1], stat, level).high == math.inf, (stat, level, need)


def test_means_and_maxima_need_few_values_and_every_target_is_listed():
    assert values_needed_for(parse_slo("ttft_p95<=1s,itl_mean<=50ms,reply_max<=9s"), 0.95) == {
        "ttft_p95": 72, "itl_mean": 2, "reply_max": 1}
    assert math.isfinite(stat_interval([0.1, 0.2], "mean").high)


def test_the_next_run_closes_the_largest_shortfall_at_the_rate_seen_so_far():
    sizing = PointSizing(base_s=8, max_run_s=90, max_point_s=150)
    needed = {"ttft_p95": 72, "itl_p95": 72}
    # 10 TTFTs in 8 s: 62 more at 1.25/s, with a margin, over the one run left.
    one = sizing.next_run_s(needed, {"ttft_p95": 10, "itl_p95": 300}, 8.0, runs_left=1)
    assert 62 / 1.25 < one <= 90
    # Spread over two runs left: each about half as long, never under the first run's length.
    assert sizing.next_run_s(needed, {"ttft_p95": 10, "itl_p95": 300}, 8.0, runs_left=2) == pytest.approx(one / 2)
    assert sizing.next_run_s(needed, {"ttft_p95": 70, "itl_p95": 300}, 8.0) == 8
    # Enough values but still straddling: the next run doubles the sample.
    assert sizing.next_run_s(needed, {"ttft_p95": 80, "itl_p95": 900}, 40.0) == 40
    # No values at all: as long as allowed; capped by the longest run and by what the point has left.
    assert sizing.next_run_s(needed, {"ttft_p95": 0}, 8.0) == 90
    assert sizing.next_run_s(needed, {"ttft_p95": 1, "itl_p95": 1}, 120.0) == 30
    assert sizing.next_run_s(needed, {"ttft_p95": 1, "itl_p95": 1}, 145.0) == 0.0  # spent: no further run
    # A point whose estimate already breaks its target needs only a lower bound above it: doubled.
    assert sizing.next_run_s(needed, {"ttft_p95": 10, "itl_p95": 300}, 8.0, leans_broken=True) == 8
    # Doubling stops at its own cap; a point short of values may still run on to the point's cap.
    capped = PointSizing(base_s=8, max_run_s=90, max_point_s=150, max_doubling_s=60)
    assert capped.next_run_s(needed, {"ttft_p95": 80, "itl_p95": 900}, 40.0) == 20
    assert capped.next_run_s(needed, {"ttft_p95": 80, "itl_p95": 900}, 56.0) == 0.0
    assert capped.next_run_s(needed, {"ttft_p95": 10, "itl_p95": 300}, 80.0, leans_broken=True) == 0.0
    assert capped.next_run_s(needed, {"ttft_p95": 40, "itl_p95": 900}, 80.0) == 70
    with pytest.raises(ConfigError, match="point sizing"):
        PointSizing(base_s=8, max_run_s=4, max_point_s=150)
    with pytest.raises(ConfigError, match="doubling cap"):
        PointSizing(base_s=8, max_run_s=90, max_point_s=150, max_doubling_s=4)


def record(ttft_s):
    return RequestRecord(conv_id=0, turn=0, character_id=0, slot=0, intended_s=0.0, end_s=ttft_s + 0.1,
                         ttft_s=ttft_s, reply_s=ttft_s + 0.1, itl_s=[0.01], output_tokens=2)


def test_a_point_leans_broken_when_an_undecided_target_is_broken_by_its_estimate():
    slo = parse_slo("ttft_p95<=1s")
    slow = judge_point([record(0.5)] * 8 + [record(1.5)] * 2, slo)
    fast = judge_point([record(0.5)] * 10, slo)
    assert slow.verdict == fast.verdict == "undecided"
    assert leans_broken(slo, slow) and not leans_broken(slo, fast)


def _bench(url, slo, duration_s, **kw):
    proto = RunProtocol(url, LoadSpec("concurrency", 1, duration_s=duration_s, warmup_s=0.0, drain_timeout_s=10),
                        parse_slo(slo), base_seed=5, **kw)
    return Bench(proto, ClientConfig("scripted"),
                 lambda seed: Workload(get_profile("cpu-roleplay"), seed, EstimateCounter()))


def test_a_sized_point_measures_until_its_p95_can_be_bounded_and_then_decides(scripted):
    # Unsized, a point of a few short runs stays undecided (a p95 needs 72 values, see
    # test_reset_sweep); sized, its later runs are as long as the shortfall needs.
    url = scripted("--ttft-ms", "2", "--itl-ms", "20")
    sizing = PointSizing(base_s=0.3, max_run_s=20, max_point_s=40)

    async def go():
        b = _bench(url, "ttft_p95<=1s", 0.3, confidence=0.95, extend_up_to=4, sizing=sizing)
        try:
            return await b.run_point(1)
        finally:
            await b.close()

    point = asyncio.run(go())
    assert point.verdict == "pass", point.judged
    assert point.judged.intervals["ttft_p95"].n >= 72
    first, *later = point.runs
    assert first.summary.window_s == 0.3 and later and later[0].summary.window_s > 0.3


def test_a_sweep_stops_when_its_budget_is_spent(scripted):
    url = scripted("--ttft-ms", "2", "--itl-ms", "1")

    async def go():
        b = _bench(url, "ttft_p50<=1s", 0.4)
        try:
            return await sweep(b, SweepSpec(start=1, max_level=64, max_points=6, budget_s=0.6))
        finally:
            await b.close()

    res = asyncio.run(go())
    assert [p.level for p in res.points] == [1, 2] and res.out_of_budget and not res.knee_reached
    assert res.knee == 2
    with pytest.raises(ConfigError, match="budget"):
        SweepSpec(start=1, max_level=4, budget_s=0)


def test_the_cpu_model_is_read_from_cpuinfo():
    assert cpu_model("processor\t: 0\nmodel name\t: Intel(R)  Xeon(R) Processor\n") == "Intel(R) Xeon(R) Processor"
    assert cpu_model("processor : 0\nModel : Raspberry Pi 4\n") == "Raspberry Pi 4"
    assert cpu_model("") != ""
    info = MachineInfo("X", 2, (1.0, 0.5, 0.25))
    assert info.describe() == "X, 2 CPUs, load average 1.00 0.50 0.25"
