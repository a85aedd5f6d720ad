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
from chatfleet.bench.point_sizing import PointSizing, target_values_needed, target_values_to_decide, values_needed_for
from chatfleet.bench.quantile_ci import stat_interval, values_needed, values_to_decide
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


def sample(n, share, inside=0.5, outside=2.0):
    """n values, floor(n * share) of them within a 1 s target."""
    k = math.floor(n * share + 1e-9)
    return np.array([inside] * k + [outside] * (n - k))


@pytest.mark.parametrize("share", [0.99, 0.98, 0.97, 0.9, 0.8, 0.5])
def test_the_projected_count_is_where_quantile_ci_decides_a_sample_with_that_share(share):
    n = values_to_decide(0.95, share)
    iv = stat_interval(sample(n, share), "p95")
    fewer = stat_interval(sample(n - 1, share), "p95")
    if share > 0.95:  # shown met at n values, not at one fewer
        assert iv.high <= 1.0 < fewer.high, (share, n)
    else:  # shown broken at n values, not at one fewer
        assert iv.low > 1.0 >= fewer.low, (share, n)


def test_a_share_at_the_percentile_never_decides_and_a_share_of_one_needs_the_bound():
    assert values_to_decide(0.95, 0.95) is None and values_to_decide(0.95, 0.951, limit=2000) is None
    assert values_to_decide(0.95, 1.0) == values_needed(0.95) == 72
    (p95,) = parse_slo("ttft_p95<=1s").targets
    # Below the interval's own need: that need, unless the sample leans broken and needs fewer.
    assert target_values_to_decide(p95, sample(10, 1.0), 0.95) == 72
    assert target_values_to_decide(p95, sample(10, 0.8), 0.95) == values_to_decide(0.95, 0.8) < 72
    # From the need on: the projection, None where none is in reach.
    assert target_values_to_decide(p95, sample(100, 0.98), 0.95) == values_to_decide(0.95, 0.98) > 100
    assert target_values_to_decide(p95, sample(100, 0.95), 0.95) is None


def test_the_next_run_closes_the_largest_shortfall_at_the_rate_seen_so_far():
    sizing = PointSizing(base_s=8, max_run_s=90, max_point_s=150)
    # 10 TTFTs in 8 s: 62 more at 1.25/s, with a margin, over the one run left.
    one = sizing.next_run_s({"ttft_p95": 72}, {"ttft_p95": 10, "itl_p95": 300}, 8.0, runs_left=1)
    assert 62 / 1.25 < one <= 90
    # Spread over two runs left: each about half as long, never under the first run's length.
    assert sizing.next_run_s({"ttft_p95": 72}, {"ttft_p95": 10}, 8.0, runs_left=2) == pytest.approx(one / 2)
    assert sizing.next_run_s({"ttft_p95": 72}, {"ttft_p95": 70}, 8.0) == 8
    # No values at all: as long as allowed; capped by the longest run and by what the point has left.
    assert sizing.next_run_s({"ttft_p95": 72}, {"ttft_p95": 0}, 8.0) == 90
    assert sizing.next_run_s({"ttft_p95": 72}, {"ttft_p95": 60}, 120.0) == pytest.approx(12 * 1.2 * 2)
    assert sizing.next_run_s({"ttft_p95": 72}, {"ttft_p95": 60}, 125.0) == 25  # what the point has left
    assert sizing.next_run_s({"ttft_p95": 72}, {"ttft_p95": 60}, 145.0) == 0.0  # spent: no further run
    # Out of reach: a count no sample reaches, or one the rate so far would not reach within the cap.
    assert sizing.next_run_s({"ttft_p95": None}, {"ttft_p95": 100}, 40.0) == 0.0
    assert sizing.next_run_s({"ttft_p95": 515}, {"ttft_p95": 100}, 40.0) == 0.0
    assert sizing.next_run_s({"ttft_p95": 142}, {"ttft_p95": 100}, 40.0) == pytest.approx(42 * 1.2 * 0.4)
    with pytest.raises(ConfigError, match="point sizing"):
        PointSizing(base_s=8, max_run_s=4, max_point_s=150)


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
