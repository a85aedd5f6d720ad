"""Latency targets written like ``ttft_p99<=1s,itl_p99<=100ms`` or ``reply_p50<=3.8s,reply_p95<=7s``.

A target is ``<metric>_<stat><=<value><unit>``: metric ``ttft`` (first content token), ``itl``
(inter-token latency), ``reply`` (whole reply), ``queue`` (client-side queueing); stat ``pNN``
(``p99``, ``p99.9``), ``mean`` or ``max``; unit ``s``, ``ms`` or ``us`` (seconds if none).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from chatfleet.errors import ConfigError

METRICS = ("ttft", "itl", "reply", "queue")
_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "": 1.0}
_TARGET = re.compile(r"\s*([a-z]+)_(p\d+(?:\.\d+)?|mean|max)\s*(<=|<)\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*")


def stat_of(values: np.ndarray | list[float], stat: str) -> float:
    """``pNN``, ``mean`` or ``max`` of ``values``; NaN for no values."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return float("nan")
    if stat == "mean":
        return float(arr.mean())
    if stat == "max":
        return float(arr.max())
    return float(np.percentile(arr, float(stat[1:]), method="inverted_cdf"))  # nearest rank; inf-safe


@dataclass(frozen=True)
class SLOTarget:
    metric: str
    stat: str
    threshold_s: float
    strict: bool = False  # '<' rather than '<='

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"unknown SLO metric {self.metric!r}; valid: {', '.join(METRICS)}")
        if self.stat.startswith("p") and not (0 < float(self.stat[1:]) <= 100):
            raise ConfigError(f"SLO percentile must be in (0, 100], got {self.stat}")
        if self.threshold_s <= 0:
            raise ConfigError(f"SLO threshold must be positive, got {self.threshold_s}")

    def ok(self, value: float) -> bool:
        if value != value:  # NaN: nothing measured
            return False
        return value < self.threshold_s if self.strict else value <= self.threshold_s

    @property
    def key(self) -> str:
        return f"{self.metric}_{self.stat}"

    def __str__(self) -> str:
        t = self.threshold_s
        value = f"{t * 1e3:g}ms" if t < 1 else f"{t:g}s"
        return f"{self.key}{'<' if self.strict else '<='}{value}"


@dataclass(frozen=True)
class SLO:
    targets: tuple[SLOTarget, ...]

    def __post_init__(self) -> None:
        if not self.targets:
            raise ConfigError("an SLO needs at least one target, e.g. 'ttft_p99<=1s'")
        keys = [t.key for t in self.targets]
        if len(set(keys)) != len(keys):
            raise ConfigError(f"SLO names a target twice: {', '.join(keys)}")

    def __str__(self) -> str:
        return ",".join(str(t) for t in self.targets)

    def request_ok(self, values: dict[str, list[float] | float | None]) -> bool:
        """Did one request meet every target? ``values`` maps metric -> its value (ITL: list).

        For ITL the request's own gaps are reduced with the target's stat; a request with no
        gaps (one token) meets any ITL target.
        """
        for t in self.targets:
            v = values.get(t.metric)
            if v is None:
                if t.metric == "itl":
                    continue
                return False
            if isinstance(v, (list, tuple, np.ndarray)):
                if len(v) == 0:
                    continue
                v = stat_of(v, t.stat)
            if not t.ok(float(v)):
                return False
        return True


def parse_slo(spec: str) -> SLO:
    """Parse ``'ttft_p99<=1s,itl_p99<=100ms'`` into an :class:`SLO`; clear errors otherwise."""
    if not spec or not spec.strip():
        raise ConfigError("empty SLO; write e.g. 'ttft_p99<=1s,itl_p99<=100ms'")
    targets = []
    for part in spec.split(","):
        m = _TARGET.fullmatch(part)
        if not m:
            raise ConfigError(
                f"cannot parse SLO target {part.strip()!r}; write <metric>_<pNN|mean|max><=<value><s|ms|us>, "
                f"metrics: {', '.join(METRICS)} (e.g. 'ttft_p99<=1s')"
            )
        metric, stat, op, value, unit = m.groups()
        targets.append(SLOTarget(metric, stat, float(value) * _UNITS[unit or ""], op == "<"))
    return SLO(tuple(targets))
