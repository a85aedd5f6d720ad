"""Paired statistics against values computed independently: Newcombe's published examples,
Tango's interval by brute force (the constrained maximum likelihood found numerically and the
score statistic inverted on a grid), exact McNemar by enumeration, the bootstrap on a case
whose answer is known."""

import math
from fractions import Fraction
from itertools import pairwise
from statistics import NormalDist

import pytest

from chatfleet.gate.stats import (
    PairedTable,
    bootstrap_mean_interval,
    bootstrap_ratio_interval,
    mcnemar_exact_p,
    newcombe_interval,
    tango_interval,
    tango_score,
)


def newcombe_table(e, f, g, h):
    """Newcombe 1998 (Stat Med 17:2635) tables: difference p1 - p2 = (f - g) / n. Ours is
    candidate - baseline = (gains - losses) / n, so f is the candidate-only cell."""
    return PairedTable(both=e, baseline_only=g, candidate_only=f, neither=h)


@pytest.mark.parametrize("cells, low, high", [
    ((36, 12, 2, 0), 0.0569, 0.3404),   # Newcombe 1998, Table II, example (a), method 10
    ((18, 12, 2, 18), 0.0562, 0.3290),  # example (b)
    ((53, 0, 0, 1), -0.0729, 0.0729),   # example (c)
])
def test_newcombe_method_10_reproduces_the_published_examples(cells, low, high):
    iv = newcombe_interval(newcombe_table(*cells))
    assert iv.low == pytest.approx(low, abs=1e-4) and iv.high == pytest.approx(high, abs=1e-4)


def brute_force_tango(gains, losses, n, confidence=0.95):
    """Score statistic with the nuisance parameter maximized numerically (golden-section search
    on the multinomial log-likelihood), inverted by a scan and bisection of |statistic| = z."""
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    m = n - gains - losses

    def loglik(q, d):  # q = P(loss), P(gain) = q + d, the rest 1 - 2q - d
        cells = ((gains, q + d), (losses, q), (m, 1 - 2 * q - d))
        if any(x <= 0 and k for k, x in cells):
            return -math.inf
        return sum(k * math.log(x) for k, x in cells if k)

    def stat(d):
        lo, hi = max(0.0, -d), (1 - d) / 2
        for _ in range(80):
            a, b = lo + (hi - lo) * 0.382, lo + (hi - lo) * 0.618
            lo, hi = (a, hi) if loglik(a, d) < loglik(b, d) else (lo, b)
        q = (lo + hi) / 2
        var = n * (2 * q + d * (1 - d))
        return (gains - losses - n * d) / math.sqrt(var) if var > 0 else math.copysign(math.inf, gains - losses - n * d)

    def edge(inside, outside):
        for _ in range(40):
            mid = (inside + outside) / 2
            inside, outside = (mid, outside) if abs(stat(mid)) <= z else (inside, mid)
        return inside

    grid = [-1 + 2 * i / 400 for i in range(1, 400)]
    ins = [d for d in grid if abs(stat(d)) <= z]
    return edge(ins[0], ins[0] - 2 / 400), edge(ins[-1], ins[-1] + 2 / 400)


@pytest.mark.parametrize("gains, losses, n", [(12, 2, 50), (2, 12, 50), (20, 40, 160), (0, 0, 54),
                                             (3, 9, 1319), (0, 5, 40), (7, 0, 40)])
def test_tango_matches_brute_force_inversion_of_the_score_statistic(gains, losses, n):
    table = PairedTable(n - gains - losses, losses, gains, 0)
    iv = tango_interval(table)
    lo, hi = brute_force_tango(gains, losses, n)
    assert iv.low == pytest.approx(lo, abs=1e-6) and iv.high == pytest.approx(hi, abs=1e-6)
    assert iv.low <= table.difference <= iv.high


def test_tango_statistic_is_zero_at_the_estimate_and_decreasing():
    assert tango_score(12, 2, 50, 0.2) == pytest.approx(0.0, abs=1e-12)
    values = [tango_score(12, 2, 50, d / 100) for d in range(-90, 91, 5)]
    assert all(a > b for a, b in pairwise(values))


def test_one_sided_bound_tightens_with_n_and_no_discordance():
    small, big = PairedTable(20, 0, 0, 0), PairedTable(1319, 0, 0, 0)
    assert tango_interval(small, 0.90).low < -0.1  # 20 questions cannot certify a 1-point drop
    assert -0.003 < tango_interval(big, 0.90).low < 0


def test_mcnemar_exact_against_enumeration():
    for b, c in [(0, 0), (1, 0), (5, 1), (12, 2), (10, 10), (0, 9)]:
        m = b + c
        probs = [Fraction(math.comb(m, k), 2 ** m) for k in range(m + 1)]
        observed = probs[c]
        exact = sum(p for p in probs if p <= observed)  # the two-sided test by probability ordering
        assert mcnemar_exact_p(PairedTable(0, b, c, 0)) == pytest.approx(float(min(1, exact)), rel=1e-12)


def test_paired_table_counts_and_bootstrap():
    t = PairedTable.from_pairs([(True, True), (True, False), (False, True), (False, True), (False, False)])
    assert (t.both, t.baseline_only, t.candidate_only, t.neither, t.n) == (1, 1, 2, 1, 5)
    assert t.difference == pytest.approx(0.2)
    constant = bootstrap_mean_interval([0.5] * 30)
    assert constant.low == constant.high == 0.5
    spread = bootstrap_ratio_interval([1, 2, 3, 4] * 10, [1, 1, 1, 1] * 10)
    assert spread.low < 2.5 < spread.high and 2.0 < spread.low and spread.high < 3.0


def test_an_empty_table_gives_no_information_instead_of_an_error():
    empty = PairedTable(0, 0, 0, 0)
    for iv in (tango_interval(empty), newcombe_interval(empty)):
        assert (iv.low, iv.high) == (-1.0, 1.0)
    assert mcnemar_exact_p(empty) == 1.0


def test_three_way_decisions_say_inconclusive_when_the_interval_straddles_the_margin():
    from chatfleet.errors import ConfigError
    from chatfleet.gate.stats import equivalence, non_inferiority

    assert non_inferiority(-0.005, 0.02, 0.01) == "pass"
    assert non_inferiority(-0.3, -0.05, 0.01) == "fail"
    assert non_inferiority(-0.12, 0.12, 0.01) == "inconclusive"
    assert equivalence(-0.01, 0.015, 0.02) == "pass"
    assert equivalence(0.03, 0.05, 0.02) == "fail" and equivalence(-0.05, -0.03, 0.02) == "fail"
    assert equivalence(0.01, 0.03, 0.02) == "inconclusive"
    with pytest.raises(ConfigError):
        non_inferiority(0.1, -0.1, 0.01)


def test_two_identical_servers_on_few_items_are_inconclusive_and_on_many_pass():
    """The gate's own GSM8K rule on an all-concordant table: 20 items cannot decide; enough do."""
    from chatfleet.gate.stats import non_inferiority

    def decide(n):
        iv = tango_interval(PairedTable(n // 2, 0, 0, n - n // 2), 0.90)  # one-sided 95% bounds
        return non_inferiority(iv.low, iv.high, 0.01)

    assert decide(20) == "inconclusive" and decide(250) == "inconclusive"  # lower bound -1.07 points
    assert decide(300) == "pass" and decide(1319) == "pass"  # -0.89 points; the full test split -0.2
    # A candidate that loses 12 of 20 questions is a fail, not merely inconclusive.
    iv = tango_interval(PairedTable(4, 12, 0, 4), 0.90)
    assert non_inferiority(iv.low, iv.high, 0.01) == "fail"
