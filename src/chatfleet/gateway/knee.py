"""Per-replica caps from a measured knee, in the gateway's unit: requests in flight.

A `chatfleet sweep` in ``closed`` mode finds its knee in *live chats*: conversations that
alternate between a request and a pause (the user reads and types). The gateway's cap counts
*requests in flight* (a chat that pauses holds none), so a cap equal to the number of live chats
admits far more concurrent work than the knee carried, and what it admits misses the SLO. The
cap is therefore the knee's load expressed as requests in flight, by Little's law: the mean
number in the system is the sum of the measured requests' times in the system over the window,
``L = sum(end - sent) / window`` (or, without per-request records, request rate x mean
latency), averaged over the knee point's kept runs, rounded down. A sweep in ``concurrency``
mode measures requests in flight directly; its knee is the cap as it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatfleet.errors import ConfigError

KNEE_KEYS = ("concurrency", "in_flight", "live_chats", "value")


@dataclass(frozen=True)
class KneeCap:
    """A measured knee and the per-replica in-flight cap it gives."""

    knee: float  # in the sweep's own unit (live chats for ``closed``)
    mode: str | None  # the sweep's load mode; None when the result does not say
    in_flight: float  # mean requests in flight at the knee
    cap: int  # what the gateway admits per replica: floor(in_flight), at least 1

    def describe(self) -> str:
        if self.mode == "closed":
            return (f"knee {self.knee:g} live chats = {self.in_flight:.2f} requests in flight "
                    f"(Little's law) -> cap {self.cap}")
        return f"knee {self.knee:g} requests in flight -> cap {self.cap}"


def _knee_number(knee: Any) -> float | None:
    if isinstance(knee, dict):
        knee = next((knee[k] for k in KNEE_KEYS if isinstance(knee.get(k), (int, float))), None)
    if isinstance(knee, bool) or not isinstance(knee, (int, float)) or not math.isfinite(knee):
        return None
    return float(knee)


def run_in_flight(run: Mapping[str, Any]) -> float | None:
    """Mean requests in flight over one measured run (a `chatfleet sweep` run dict)."""
    summary = run.get("summary") or {}
    window = summary.get("window_s")
    if not isinstance(window, (int, float)) or window <= 0:
        return None
    records = [r for r in run.get("records") or [] if not r.get("warmup")]
    spans = [r["end_s"] - r["sent_s"] for r in records
             if isinstance(r.get("end_s"), (int, float)) and isinstance(r.get("sent_s"), (int, float))]
    if spans:
        return float(sum(spans) / window)
    rate = summary.get("request_rate")
    mean = ((summary.get("latency") or {}).get("reply") or {}).get("mean")
    if isinstance(rate, (int, float)) and isinstance(mean, (int, float)) and math.isfinite(mean):
        return rate * mean
    return None


def in_flight_at(series: Mapping[str, Any], level: float) -> float | None:
    """Mean requests in flight at load ``level`` of a sweep series (its kept runs averaged)."""
    point = next((p for p in series.get("points") or [] if p.get("level") == level), None)
    if point is None:
        return None
    runs = point.get("runs") or []
    kept = [r for r in runs if not r.get("throttled")] or runs
    values = [v for v in (run_in_flight(r) for r in kept) if v is not None]
    return sum(values) / len(values) if values else None


def knee_cap(path: str | Path, series: str | None = None) -> KneeCap:
    """The per-replica cap from a `chatfleet sweep` (or `demo`) result.

    The knee comes from a top-level ``knee`` (a number of requests in flight, or a mapping
    holding one under ``concurrency``, ``in_flight``, ``live_chats`` or ``value``), else from
    ``series[NAME].knee`` as `chatfleet sweep` writes it: the only series, or ``series``. A
    ``closed``-mode series' knee (live chats) is converted to requests in flight (see the module
    docstring); a closed-mode knee without its point's measurements is refused.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read sweep result {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"sweep result {path} is not a JSON object")
    knee = _knee_number(data.get("knee")) if series is None else None
    chosen: Mapping[str, Any] = {}
    all_series = data.get("series") if isinstance(data.get("series"), dict) else {}
    if knee is None and all_series:
        if series is None and len(all_series) > 1:
            found = {name: (s or {}).get("knee") for name, s in all_series.items()}
            raise ConfigError(f"sweep result {path} holds several series {found}; choose one")
        name = series if series is not None else next(iter(all_series))
        if name not in all_series:
            raise ConfigError(f"sweep result {path} has no series {name!r}; it has {sorted(all_series)}")
        chosen = all_series[name] or {}
        knee = _knee_number(chosen.get("knee"))
    if knee is None:
        raise ConfigError(f"sweep result {path} has no numeric knee (did the lowest load already "
                          "break the SLO?)")
    mode = chosen.get("mode") if isinstance(chosen.get("mode"), str) else None
    in_flight = knee
    if mode == "closed":
        measured = in_flight_at(chosen, knee)
        if measured is None:
            raise ConfigError(f"sweep result {path}: the knee is {knee:g} live chats, but the result holds no "
                              "measurements of that point to turn it into requests in flight; give "
                              "--max-in-flight instead")
        in_flight = measured
    elif mode == "open":
        raise ConfigError(f"sweep result {path} is an open-loop sweep (its knee is new chats per second); "
                          "caps need a closed or concurrency sweep, or --max-in-flight")
    cap = int(in_flight)
    if cap < 1:
        raise ConfigError(f"sweep result {path}: knee {knee:g} ({in_flight:.2f} requests in flight) gives no "
                          "usable cap (need >= 1)")
    return KneeCap(knee=knee, mode=mode, in_flight=in_flight, cap=cap)


def read_knee(path: str | Path, series: str | None = None) -> int:
    """The per-replica in-flight cap from a sweep result (``knee_cap(...).cap``)."""
    return knee_cap(path, series).cap
