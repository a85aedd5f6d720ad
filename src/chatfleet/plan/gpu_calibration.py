"""A card's step costs measured on the card: the planner's calibration from a ``gpu_check`` run.

``benchmarks/gpu_check.sh`` writes decode steps of an 8B-shaped model at several batch sizes,
each with its floor (bytes read / the card's measured copy bandwidth) and its measured time.
Committed under ``plan/calibrations/`` with the catalog name of the card (``card``) and its
``date``, the file fits the step-cost model's memory efficiency and fixed step overhead:

    step_ms = overhead_ms + spec_ms / memory,   spec_ms = floor_ms x measured GB/s / spec GB/s

(``spec_ms``: the step's bytes at the spec-sheet bandwidth the cost model divides by), by least
squares over the engine's own rows (its path, CUDA graphs where measured, bf16 weights). The
compute efficiency keeps the catalog's value (a decode step is bound by bytes). Torch-free; the
catalog applies what this module fits (``catalog.load_catalog``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from chatfleet.errors import ConfigError

MEMORY_LIMITS = (1e-3, 1.5)  # the catalog's bounds on an efficiency


@dataclass(frozen=True)
class MeasuredDecode:
    """The decode rows of one gpu_check run on one card."""

    card: str
    date: str
    device: str  # what torch called the card
    bandwidth_gbps: float  # the run's measured copy bandwidth
    points: tuple[tuple[float, float], ...]  # (floor_ms, step_ms) of the rows used
    source: str  # the file


@dataclass(frozen=True)
class StepFit:
    memory: float  # achieved / spec bandwidth
    step_overhead_ms: float
    measured: MeasuredDecode

    def describe(self) -> str:
        m = self.measured
        return (f"calibrated {m.date} ({Path(m.source).name}: memory x{self.memory:.2f}, "
                f"{self.step_overhead_ms:.2f} ms a step, {len(m.points)} decode rows)")


def _engine_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The rows of the engine's own configuration: its path, graphs where any were measured, bf16."""
    ok = [r for r in rows if r.get("step_ms") and r.get("floor_ms") and r.get("weights", "bf16") == "bf16"]
    ok = [r for r in ok if r.get("path", "engine") == "engine"] or ok
    return [r for r in ok if r.get("graphs")] or ok


def read_measured(doc: object, source: str) -> MeasuredDecode:
    """The decode rows of a gpu_check JSON document (``source`` names it in errors)."""
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: expected a JSON object (gpu_check.json)")
    card, date = doc.get("card"), doc.get("date")
    if not isinstance(card, str) or not card:
        raise ConfigError(f"{source}: no 'card' (the catalog name this run calibrates, e.g. \"H200\")")
    if not isinstance(date, str) or not date:
        raise ConfigError(f"{source}: no 'date'")
    bw = doc.get("bandwidth_gbps")
    if not isinstance(bw, (int, float)) or bw <= 0:
        raise ConfigError(f"{source}: no measured bandwidth_gbps")
    rows = doc.get("decode")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{source}: no 'decode' rows")
    points = tuple((float(r["floor_ms"]), float(r["step_ms"])) for r in _engine_rows(rows))  # type: ignore[arg-type]
    if not points:
        raise ConfigError(f"{source}: no decode row with a measured step and floor")
    return MeasuredDecode(card, date[:10], str(doc.get("device", "")), float(bw), points, source)


def fit(measured: MeasuredDecode, spec_bandwidth_gbps: float) -> StepFit:
    """The memory efficiency and step overhead that best explain the measured steps."""
    xs = [floor * measured.bandwidth_gbps / spec_bandwidth_gbps for floor, _ in measured.points]
    ys = [step for _, step in measured.points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    overhead = my - slope * mx
    if slope <= 0 or overhead < 0:  # one size, or noise: no overhead, the bandwidth through the origin
        overhead, slope = 0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
    lo, hi = MEMORY_LIMITS
    return StepFit(min(hi, max(lo, 1.0 / slope)), overhead, measured)


def read_calibration_files(paths: Iterable[Path]) -> dict[str, MeasuredDecode]:
    """The newest measured run per card (lower-cased card name -> run) among ``paths``."""
    out: dict[str, MeasuredDecode] = {}
    for path in sorted(paths):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"calibration {path}: {e}") from None
        m = read_measured(doc, str(path))
        key = m.card.lower()
        if key not in out or m.date >= out[key].date:
            out[key] = m
    return out


def packaged_calibrations() -> list[Path]:
    """The calibration files committed with the planner (``plan/calibrations/*.json``)."""
    folder = resources.files("chatfleet.plan").joinpath("calibrations")
    if not folder.is_dir():
        return []
    return [Path(str(f)) for f in folder.iterdir() if f.name.endswith(".json")]
