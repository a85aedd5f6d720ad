"""How sure a measured percentile is: distribution-free confidence intervals from order statistics.

For a sample of n values, the true q-quantile lies between the l-th and the u-th smallest with
probability F(u-1) - F(l-1), F the Binomial(n, q) CDF; the ranks are chosen with equal tails.
Exact for any distribution (no bootstrap, no normality), cheap (one sort), and honest about small
samples: an upper bound for p99 needs at least 368 values at 95% (``values_needed``); with fewer
the interval is open above (``high`` is infinite) and no SLO can be shown to hold.

``mean`` gets a Student-t interval; ``max`` is the sample's own (its interval has no width).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from chatfleet.bench.slo import stat_of
from chatfleet.errors import ConfigError

_EXACT_UP_TO = 200_000  # larger samples use the normal approximation of the binomial ranks


@dataclass(frozen=True)
class StatInterval:
    """``stat`` of a sample: its estimate, a ``level`` confidence interval and the sample size."""

    stat: str
    estimate: float
    low: float  # -inf: the sample cannot bound it below
    high: float  # inf: the sample cannot bound it above
    n: int
    level: float

    def to_dict(self) -> dict:
        return {"stat": self.stat, "estimate": self.estimate, "low": self.low, "high": self.high, "n": self.n,
                "level": self.level}

    @classmethod
    def from_dict(cls, d: dict) -> StatInterval:
        return cls(d["stat"], d["estimate"], d["low"], d["high"], d["n"], d["level"])


def _binomial_cdf(n: int, q: float) -> np.ndarray:
    """F(k) = P(Binomial(n, q) <= k) for k = 0..n."""
    k = np.arange(1, n + 1, dtype=float)
    log_pmf = np.empty(n + 1)
    log_pmf[0] = n * math.log1p(-q)
    log_pmf[1:] = log_pmf[0] + np.cumsum(np.log((n - k + 1) / k) + math.log(q / (1 - q)))
    pmf = np.exp(log_pmf - log_pmf.max())
    cdf = np.cumsum(pmf)
    return cdf / cdf[-1]


def order_ranks(n: int, q: float, level: float = 0.95) -> tuple[int, int]:
    """1-based ranks (l, u) with P(x_(l) <= quantile_q <= x_(u)) >= level; 0 and n + 1 mean unbounded."""
    if not 0 < q < 1:
        raise ConfigError(f"quantile must be in (0, 1), got {q}")
    if not 0 < level < 1:
        raise ConfigError(f"confidence level must be in (0, 1), got {level}")
    if n == 0:
        return 0, 1
    tail = (1 - level) / 2
    if n > _EXACT_UP_TO:
        z = NormalDist().inv_cdf(1 - tail)
        half = z * math.sqrt(n * q * (1 - q))
        return max(0, math.floor(n * q - half)), min(n + 1, math.ceil(n * q + half) + 1)
    cdf = _binomial_cdf(n, q)
    # low rank: the largest l with F(l - 1) <= tail (l = 0 when even F(0) exceeds it)
    low = int(np.searchsorted(cdf, tail, side="right"))  # F(0..low-1) <= tail
    # high rank: the smallest u with F(u - 1) >= 1 - tail (n + 1 when F(n - 1) falls short)
    high = int(np.searchsorted(cdf[:n], 1 - tail, side="left")) + 1
    return low, min(high, n + 1)


def values_needed(q: float, level: float = 0.95) -> int:
    """The smallest sample whose ``level`` interval for the q-quantile is bounded above."""
    return math.ceil(math.log((1 - level) / 2) / math.log(q))


def values_to_decide(q: float, share_within: float, level: float = 0.95, limit: int = 20_000) -> int | None:
    """The fewest values at which a sample with ``share_within`` of its values inside a target
    would decide the q-quantile against it, if more values keep that share: for a share above q,
    the interval's upper rank falls within those values (shown met); below q, its lower rank lies
    past them (shown broken). None: not within ``limit`` values (a share at q never decides).
    A share of 1 gives ``values_needed``: a bound above at all."""
    if not 0 <= share_within <= 1:
        raise ConfigError(f"share within the target must be in [0, 1], got {share_within}")

    def decides(n: int) -> bool:
        low, high = order_ranks(n, q, level)
        within = math.floor(n * share_within + 1e-9)
        return high <= within if share_within > q else low > within

    if share_within == q or not decides(limit):
        return None
    hi = 1
    while not decides(hi):  # a bracket by doubling, then the smallest n by bisection
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if decides(mid):
            hi = mid
        else:
            lo = mid
    return hi


def stat_interval(values: np.ndarray | list[float], stat: str, level: float = 0.95) -> StatInterval:
    """Estimate (as ``slo.stat_of``: nearest rank) and interval of ``pNN``, ``mean`` or ``max``."""
    arr = np.sort(np.asarray(values, dtype=float))
    n = int(arr.size)
    est = stat_of(arr, stat)
    if n == 0:
        return StatInterval(stat, est, -math.inf, math.inf, 0, level)
    if stat == "max" or (stat.startswith("p") and float(stat[1:]) >= 100):
        return StatInterval(stat, est, est, est, n, level)
    if stat == "mean":
        finite = arr[np.isfinite(arr)]
        if finite.size < n or n == 1:  # a failed request (inf) or one value: no bound above
            return StatInterval(stat, est, float(finite.min()) if finite.size else -math.inf, math.inf, n, level)
        t = NormalDist().inv_cdf(1 - (1 - level) / 2) if n > 30 else _t_quantile(n - 1, level)
        half = t * float(arr.std(ddof=1)) / math.sqrt(n)
        return StatInterval(stat, est, est - half, est + half, n, level)
    low, high = order_ranks(n, float(stat[1:]) / 100, level)
    return StatInterval(stat, est, float(arr[low - 1]) if low >= 1 else -math.inf,
                        float(arr[high - 1]) if high <= n else math.inf, n, level)


def _t_quantile(df: int, level: float) -> float:
    """Two-sided Student-t quantile (Cornish-Fisher expansion from the normal; close for df >= 2)."""
    z = NormalDist().inv_cdf(1 - (1 - level) / 2)
    if df == 1:
        return math.tan(math.pi * level / 2)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / df + g2 / df**2 + g3 / df**3
