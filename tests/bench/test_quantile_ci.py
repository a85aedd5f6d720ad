"""Order-statistic intervals for percentiles, and a load point's pass / fail / undecided verdict."""

import math

import numpy as np
import pytest

from chatfleet.bench.point_verdict import judge_point, target_verdict, why_undecided
from chatfleet.bench.quantile_ci import StatInterval, order_ranks, stat_interval, values_needed
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import parse_slo
from chatfleet.errors import ConfigError


def brute_coverage(n, q, low, high):
    """P(x_(low) <= true quantile <= x_(high)) from the binomial pmf, with 0 / n + 1 unbounded."""
    pmf = [math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(n + 1)]
    return sum(pmf[max(low, 0):min(high, n + 1)])


@pytest.mark.parametrize("n,q", [(5, 0.5), (20, 0.5), (20, 0.95), (60, 0.9), (200, 0.99), (400, 0.99)])
def test_ranks_cover_at_the_stated_level_and_no_wider_than_needed(n, q):
    low, high = order_ranks(n, q, 0.95)
    assert 0 <= low < high <= n + 1
    assert brute_coverage(n, q, low, high) >= 0.95 - 1e-12
    # Equal tails, each as tight as it can be: one rank closer on either side drops below its tail.
    below = sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(low))
    assert below <= 0.025 + 1e-12
    if low < n:
        assert below + math.comb(n, low) * q**low * (1 - q) ** (n - low) > 0.025
    above = sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(high, n + 1))
    assert above <= 0.025 + 1e-12


def test_interval_contains_the_true_quantile_at_the_stated_rate_on_simulated_data():
    rng = np.random.default_rng(7)
    trials = 1500
    for n, q in ((30, 0.5), (120, 0.95), (500, 0.99)):
        true = -math.log(1 - q)  # exponential(1)
        hits = 0
        for _ in range(trials):
            iv = stat_interval(rng.exponential(size=n), f"p{q * 100:g}")
            hits += iv.low <= true <= iv.high
        # Exact intervals cover at least 95%; 3 standard errors of 1500 trials below that fails.
        assert hits / trials >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / trials), (n, q, hits / trials)
        assert hits / trials <= 0.995, (n, q, hits / trials)  # and are not vacuous


def test_small_samples_cannot_bound_a_high_percentile_from_above():
    assert values_needed(0.99) == 368 and values_needed(0.95) == 72
    few = stat_interval(np.linspace(0.1, 0.2, 367), "p99")
    assert few.high == math.inf and few.low > 0 and few.n == 367
    enough = stat_interval(np.linspace(0.1, 0.2, 368), "p99")
    assert enough.high == pytest.approx(0.2)


def test_large_samples_use_the_normal_ranks_close_to_the_exact_ones():
    n = 200_000
    exact = order_ranks(n, 0.99)
    approx = order_ranks(n + 1, 0.99)  # just past the exact limit
    assert abs(approx[0] - exact[0]) <= 3 and abs(approx[1] - exact[1]) <= 3


def test_mean_max_and_failures():
    iv = stat_interval([1.0, 2.0, 3.0, 4.0], "mean")
    assert iv.estimate == 2.5 and iv.low < 2.5 < iv.high
    assert stat_interval([1.0, float("inf")], "mean").high == math.inf
    m = stat_interval([1.0, 5.0], "max")
    assert m.low == m.high == 5.0
    empty = stat_interval([], "p50")
    assert empty.n == 0 and empty.low == -math.inf and empty.high == math.inf
    with pytest.raises(ConfigError):
        order_ranks(10, 1.5)
    assert StatInterval.from_dict(iv.to_dict()) == iv


def rec(i, ttft, status="ok"):
    return RequestRecord(conv_id=i, turn=0, character_id=0, slot=0, intended_s=0.0, ttft_s=ttft, reply_s=ttft,
                         status=status, itl_s=[0.01, 0.01])


def test_point_verdict_pass_fail_undecided():
    slo = parse_slo("ttft_p50<=1s")
    fast = [rec(i, 0.1 + 0.001 * i) for i in range(50)]
    slow = [rec(i, 2.0 + 0.001 * i) for i in range(50)]
    assert judge_point(fast, slo).verdict == "pass"
    assert judge_point(slow, slo).verdict == "fail"
    # Half fast, half slow: the median's interval straddles 1 s.
    mixed = judge_point(fast[:25] + slow[:25], slo)
    assert mixed.verdict == "undecided" and mixed.targets == {"ttft_p50": "undecided"}
    assert mixed.intervals["ttft_p50"].n == 50
    # p99 over 50 requests, all fast: still undecided, and the console says what would decide it.
    p99 = parse_slo("ttft_p99<=1s")
    j = judge_point(fast, p99)
    assert j.verdict == "undecided"
    assert ">= 368 values" in why_undecided(p99.targets[0], j.intervals["ttft_p99"])
    # One target failing fails the point whatever the others say; failed requests count as slow.
    both = parse_slo("ttft_p99<=1s,itl_p50<=1ms")
    assert judge_point(fast, both).verdict == "fail"
    errors = [rec(i, None, status="error") for i in range(50)]
    assert judge_point(errors, slo).verdict == "fail"
    assert judge_point([], slo).verdict == "fail"


def test_target_verdict_uses_the_strictness():
    t = parse_slo("ttft_p50<1s").targets[0]
    assert target_verdict(t, StatInterval("p50", 0.9, 0.8, 1.0, 10, 0.95)) == "undecided"
    assert target_verdict(t, StatInterval("p50", 1.2, 1.0, 1.5, 10, 0.95)) == "fail"
