"""Paired statistics for the gate: the 2x2 table of two systems on the same items, and intervals.

The difference is always *candidate minus baseline*. For a paired table with ``b`` items only
the baseline got right and ``c`` items only the candidate got right, out of ``n``:

- Tango's score interval (T. Tango, Stat Med 1998;17:891-908): the set of differences whose
  score statistic, with the other cell probability at its constrained maximum-likelihood value,
  stays within the normal quantile. It is the gate's decision interval.
- Newcombe's square-and-add interval (R. G. Newcombe, Stat Med 1998;17:2635-2650, method 10):
  Wilson intervals of the two marginal proportions combined with the phi correlation.
- The exact McNemar test: two-sided binomial test of ``c`` among ``b + c`` at 1/2.
- A percentile bootstrap of a mean over resampled units (conversations, questions).

Decisions are three-way (``non_inferiority``, ``equivalence``): "pass" where the interval shows
the candidate within the margin, "fail" where it shows the candidate beyond it, "inconclusive"
where it straddles the margin: too few items to decide either way (two identical servers on 20
GSM8K questions are inconclusive, not a fail).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from statistics import NormalDist

from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    confidence: float  # two-sided coverage, e.g. 0.95
    method: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PairedTable:
    """Counts of items by (baseline right?, candidate right?)."""

    both: int  # a: both right
    baseline_only: int  # b: baseline right, candidate wrong (a loss)
    candidate_only: int  # c: candidate right, baseline wrong (a gain)
    neither: int  # d

    def __post_init__(self) -> None:
        if min(self.both, self.baseline_only, self.candidate_only, self.neither) < 0:
            raise ConfigError("2x2 counts must be >= 0")

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[bool, bool]]) -> PairedTable:
        """``pairs``: (baseline right, candidate right) per item."""
        a = sum(1 for x, y in pairs if x and y)
        b = sum(1 for x, y in pairs if x and not y)
        c = sum(1 for x, y in pairs if y and not x)
        return cls(a, b, c, len(pairs) - a - b - c)

    @property
    def n(self) -> int:
        return self.both + self.baseline_only + self.candidate_only + self.neither

    @property
    def baseline_rate(self) -> float:
        return (self.both + self.baseline_only) / self.n if self.n else 0.0

    @property
    def candidate_rate(self) -> float:
        return (self.both + self.candidate_only) / self.n if self.n else 0.0

    @property
    def difference(self) -> float:
        return (self.candidate_only - self.baseline_only) / self.n if self.n else 0.0

    @property
    def disagreement(self) -> float:
        return (self.baseline_only + self.candidate_only) / self.n if self.n else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "n": self.n, "baseline_rate": self.baseline_rate,
                "candidate_rate": self.candidate_rate, "difference": self.difference}


def _z(confidence: float) -> float:
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def tango_score(gains: int, losses: int, n: int, delta: float) -> float:
    """Tango's score statistic for H0: difference = ``delta`` (decreasing in ``delta``)."""
    if n <= 0:
        raise ConfigError("n must be > 0")
    w = -gains - losses + (2 * n - gains + losses) * delta
    q = (math.sqrt(max(0.0, w * w + 8 * n * losses * delta * (1 - delta))) - w) / (4 * n)  # P(loss) at H0
    var = n * (2 * q + delta * (1 - delta))
    diff = gains - losses - n * delta
    if var <= 0:
        return 0.0 if diff == 0 else math.copysign(math.inf, diff)
    return diff / math.sqrt(var)


def _bisect(f, lo: float, hi: float, tol: float = 1e-10) -> float:
    """Root of an increasing-or-decreasing ``f`` with a sign change on [lo, hi]."""
    flo = f(lo)
    for _ in range(200):
        mid = (lo + hi) / 2
        fm = f(mid)
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
        if hi - lo < tol:
            break
    return (lo + hi) / 2


def tango_interval(table: PairedTable, confidence: float = 0.95) -> Interval:
    z, n, g, l_ = _z(confidence), table.n, table.candidate_only, table.baseline_only
    if n == 0:  # no pairs: no information
        return Interval(-1.0, 1.0, confidence, "tango-score")
    est = table.difference
    low = -1.0 if tango_score(g, l_, n, -1.0) <= z else _bisect(lambda d: tango_score(g, l_, n, d) - z, -1.0, est)
    high = 1.0 if tango_score(g, l_, n, 1.0) >= -z else _bisect(lambda d: tango_score(g, l_, n, d) + z, est, 1.0)
    return Interval(low, high, confidence, "tango-score")


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    z = _z(confidence)
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (2 * n * p + z * z) / (2 * (n + z * z))
    half = z * math.sqrt(z * z + 4 * n * p * (1 - p)) / (2 * (n + z * z))
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe_interval(table: PairedTable, confidence: float = 0.95) -> Interval:
    """Newcombe's method 10 (no continuity correction), for candidate minus baseline."""
    a, b, c, d, n = table.both, table.baseline_only, table.candidate_only, table.neither, table.n
    if n == 0:
        return Interval(-1.0, 1.0, confidence, "newcombe-10")
    p_cand, p_base = (a + c) / n, (a + b) / n
    l1, u1 = wilson_interval(a + c, n, confidence)
    l2, u2 = wilson_interval(a + b, n, confidence)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    phi = 0.0
    if margins > 0:  # Newcombe's phi: shrunk towards 0 by n/2 when positive (as in his Table II)
        phi = (cross - n / 2 if cross > n / 2 else (cross if cross < 0 else 0.0)) / math.sqrt(margins)
    est = p_cand - p_base
    lower = est - math.sqrt(max(0.0, (p_cand - l1) ** 2 - 2 * phi * (p_cand - l1) * (u2 - p_base) + (u2 - p_base) ** 2))
    upper = est + math.sqrt(max(0.0, (u1 - p_cand) ** 2 - 2 * phi * (u1 - p_cand) * (p_base - l2) + (p_base - l2) ** 2))
    return Interval(max(-1.0, lower), min(1.0, upper), confidence, "newcombe-10")


def mcnemar_exact_p(table: PairedTable) -> float:
    """Two-sided exact McNemar p-value: 2 x P(X <= min(b, c)) for X ~ Bin(b + c, 1/2), capped at 1."""
    b, c = table.baseline_only, table.candidate_only
    m = b + c
    if m == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(m, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2 ** m)


def bootstrap_ratio_interval(numerators: Sequence[float], denominators: Sequence[float], confidence: float = 0.95,
                             resamples: int = 2000, seed: int = 0) -> Interval:
    """Percentile bootstrap interval of sum(numerators) / sum(denominators), resampling units.

    With all denominators 1 it is the interval of a mean. Used for the mean per-token dNLL,
    resampling conversations (tokens of one conversation are not independent).
    """
    if not numerators or len(numerators) != len(denominators):
        raise ConfigError("give one numerator and one denominator per unit")
    _z(confidence)
    rng = random.Random(seed)
    n = len(numerators)
    stats = []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        den = sum(denominators[i] for i in idx)
        stats.append(sum(numerators[i] for i in idx) / den if den else 0.0)
    stats.sort()
    tail = (1 - confidence) / 2
    lo = stats[min(resamples - 1, int(math.floor(tail * resamples)))]
    hi = stats[min(resamples - 1, int(math.ceil((1 - tail) * resamples)) - 1)]
    return Interval(lo, hi, confidence, "bootstrap-percentile")


def bootstrap_mean_interval(values: Sequence[float], confidence: float = 0.95, resamples: int = 2000,
                            seed: int = 0) -> Interval:
    return bootstrap_ratio_interval(values, [1.0] * len(values), confidence, resamples, seed)


DECISIONS = ("pass", "fail", "inconclusive")


def non_inferiority(low: float, high: float, margin: float) -> str:
    """Candidate minus baseline in [low, high]: 'pass' if low >= -margin (no worse than the margin),
    'fail' if high < -margin (worse by more than the margin), else 'inconclusive'."""
    if margin < 0 or low > high:
        raise ConfigError(f"need margin >= 0 and low <= high, got margin={margin} [{low}, {high}]")
    if low >= -margin:
        return "pass"
    if high < -margin:
        return "fail"
    return "inconclusive"


def equivalence(low: float, high: float, margin: float) -> str:
    """'pass' if [low, high] lies within +-margin, 'fail' if it lies wholly outside (above margin or
    below -margin), else 'inconclusive'."""
    if margin < 0 or low > high:
        raise ConfigError(f"need margin >= 0 and low <= high, got margin={margin} [{low}, {high}]")
    if -margin <= low and high <= margin:
        return "pass"
    if low > margin or high < -margin:
        return "fail"
    return "inconclusive"
