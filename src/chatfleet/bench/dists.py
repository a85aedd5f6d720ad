"""Seeded value distributions for workload knobs, written like ``lognormal(mean=900,sigma=0.5,min=200)``.

Kinds are a registry: ``const``, ``uniform``, ``lognormal``, ``exponential``, ``normal``.
Every kind accepts optional ``min`` and ``max`` clamps.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

from chatfleet.errors import ConfigError

# kind -> (required params, optional params besides min/max)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "const": (("value",), ()),
    "uniform": (("low", "high"), ()),
    "lognormal": (("mean", "sigma"), ()),  # mean of the distribution itself, sigma of log
    "exponential": (("mean",), ()),
    "normal": (("mean", "std"), ()),
}


@dataclass(frozen=True)
class Dist:
    """One distribution: ``kind`` from ``KINDS`` with its parameters, clamped to [min, max]."""

    kind: str
    params: tuple[tuple[str, float], ...] = field(default=())
    min: float | None = None
    max: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown distribution {self.kind!r}; valid: {', '.join(KINDS)}")
        required, optional = KINDS[self.kind]
        names = {k for k, _ in self.params}
        missing = [r for r in required if r not in names]
        if missing:
            raise ConfigError(f"distribution {self.kind} needs {', '.join(missing)}")
        extra = names - set(required) - set(optional)
        if extra:
            raise ConfigError(f"distribution {self.kind} does not take {', '.join(sorted(extra))}")
        p = self.p
        if self.kind == "uniform" and p["low"] > p["high"]:
            raise ConfigError("uniform needs low <= high")
        if self.kind in ("lognormal", "exponential") and p["mean"] <= 0:
            raise ConfigError(f"{self.kind} needs mean > 0")
        if p.get("sigma", 0) < 0 or p.get("std", 0) < 0:
            raise ConfigError("sigma/std must be >= 0")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ConfigError(f"min {self.min} > max {self.max}")

    @property
    def p(self) -> dict[str, float]:
        return dict(self.params)

    def sample(self, rng: random.Random) -> float:
        p = self.p
        if self.kind == "const":
            x = p["value"]
        elif self.kind == "uniform":
            x = rng.uniform(p["low"], p["high"])
        elif self.kind == "lognormal":
            sigma = p["sigma"]
            x = rng.lognormvariate(math.log(p["mean"]) - sigma * sigma / 2, sigma)
        elif self.kind == "exponential":
            x = rng.expovariate(1.0 / p["mean"])
        else:
            x = rng.gauss(p["mean"], p["std"])
        if self.min is not None:
            x = max(x, self.min)
        if self.max is not None:
            x = min(x, self.max)
        return x

    def sample_int(self, rng: random.Random) -> int:
        return max(int(round(self.sample(rng))), int(self.min) if self.min is not None else 0)

    def __str__(self) -> str:
        items = [f"{k}={v:g}" for k, v in self.params]
        if self.min is not None:
            items.append(f"min={self.min:g}")
        if self.max is not None:
            items.append(f"max={self.max:g}")
        return f"{self.kind}({','.join(items)})"


def make(kind: str, min: float | None = None, max: float | None = None, **params: float) -> Dist:
    return Dist(kind, tuple((k, float(v)) for k, v in params.items()), min, max)


def with_mean(dist: Dist, mean: float) -> Dist:
    """``dist`` with its ``mean`` parameter replaced (same kind, spread and clamps)."""
    if "mean" not in dict(dist.params):
        raise ConfigError(f"a {dist.kind} distribution has no mean to set")
    return Dist(dist.kind, tuple((k, float(mean) if k == "mean" else v) for k, v in dist.params), dist.min, dist.max)


_SPEC = re.compile(r"\s*([a-z_]+)\s*(?:\((.*)\))?\s*")


def parse_dist(spec: str) -> Dist:
    """``'lognormal(mean=900,sigma=0.5,min=200)'``, ``'uniform(low=1,high=3)'`` or a bare number."""
    try:
        return make("const", value=float(spec))
    except ValueError:
        pass
    m = _SPEC.fullmatch(spec)
    if not m:
        raise ConfigError(f"cannot parse distribution {spec!r}; write e.g. 'lognormal(mean=900,sigma=0.5)'")
    kind, body = m.group(1), m.group(2) or ""
    params: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"distribution parameter {item!r} must be name=value")
        try:
            params[key.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"distribution parameter {key.strip()} must be a number, got {value!r}") from None
    lo, hi = params.pop("min", None), params.pop("max", None)
    return Dist(kind, tuple(params.items()), lo, hi)


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity weights 1/rank^s for ranks 1..n (not normalized)."""
    if n < 1:
        raise ConfigError("need at least one item for Zipf popularity")
    if s < 0:
        raise ConfigError("Zipf exponent must be >= 0")
    return [1.0 / (rank**s) for rank in range(1, n + 1)]
