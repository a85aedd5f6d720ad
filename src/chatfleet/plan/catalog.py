"""The GPU catalog: spec-sheet rates and the efficiency factors that turn them into achieved ones.

``load_catalog(extra=None)`` reads the packaged ``gpus.yaml`` and, optionally, a user's file of
the same layout (its entries replace packaged ones of the same name, or add new GPUs).
``Catalog.get(name)`` finds a GPU by name or alias, case-insensitively; an unknown name fails
listing the known ones. Every entry is validated on load (``ConfigError`` naming the file, the
GPU and the field). Cards measured on the card itself (``gpu_check`` runs committed under
``plan/calibrations/``, ``gpu_calibration.py``) get the memory efficiency and step overhead
fitted from them and say so (``GpuSpec.step_costs``); the others are extrapolated from their
spec sheet and the efficiencies here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import yaml

from chatfleet.engine.config import parse_memory_size
from chatfleet.errors import ConfigError
from chatfleet.plan.gpu_calibration import MeasuredDecode, fit, packaged_calibrations, read_calibration_files

_FIELDS = ("memory", "memory_bandwidth_gbps", "bf16_tflops", "fp8_tflops", "pcie_gbps", "p2p_gbps",
           "aliases", "efficiency", "source")
_REQUIRED = ("memory", "memory_bandwidth_gbps", "bf16_tflops", "pcie_gbps")


@dataclass(frozen=True)
class Efficiency:
    """Achieved / peak, per resource, plus a fixed cost per engine step (scheduling, launches).

    Defaults are typical of a tuned serving engine on a datacenter GPU; ``plan calibrate`` fits
    them from a measured sweep.
    """

    compute: float = 0.6
    memory: float = 0.75
    pcie: float = 0.8
    step_overhead_ms: float = 2.0

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "pcie"):
            v = getattr(self, name)
            if not 0 < v <= 1.5:
                raise ConfigError(f"efficiency.{name} must be in (0, 1.5], got {v}")
        if self.step_overhead_ms < 0:
            raise ConfigError(f"efficiency.step_overhead_ms must be >= 0, got {self.step_overhead_ms}")


@dataclass(frozen=True)
class GpuSpec:
    """One GPU (or GPU-like device). Rates are peak spec-sheet numbers, dense."""

    name: str
    memory_bytes: int
    memory_bandwidth_gbps: float  # GB/s
    bf16_tflops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores (FP8 weights run at the BF16 rate)
    pcie_gbps: float  # host <-> device, one direction
    p2p_gbps: float  # device <-> device, one direction
    aliases: tuple[str, ...] = ()
    efficiency: Efficiency = field(default_factory=Efficiency)
    source: str = ""
    calibration: str = ""  # where its efficiencies were measured ("": extrapolated)

    @property
    def step_costs(self) -> str:
        """How the planner's step costs for this card were obtained."""
        return self.calibration or "extrapolated (spec sheet x catalog efficiencies)"

    def flops_per_s(self, precision: str) -> float:
        """Peak dense tensor FLOP/s for weights in ``precision`` ("fp8" or anything 16-bit)."""
        rate = self.fp8_tflops if precision == "fp8" and self.fp8_tflops else self.bf16_tflops
        return rate * 1e12

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.memory_bandwidth_gbps * 1e9

    @property
    def pcie_bytes_per_s(self) -> float:
        return self.pcie_gbps * 1e9

    def with_efficiency(self, efficiency: Efficiency) -> GpuSpec:
        return replace(self, efficiency=efficiency)

    def to_yaml_entry(self) -> dict:
        """This GPU as a catalog entry (what ``plan calibrate`` writes)."""
        e = self.efficiency
        return {"memory": f"{self.memory_bytes}B", "memory_bandwidth_gbps": self.memory_bandwidth_gbps,
                "bf16_tflops": self.bf16_tflops, "fp8_tflops": self.fp8_tflops, "pcie_gbps": self.pcie_gbps,
                "p2p_gbps": self.p2p_gbps, "aliases": list(self.aliases),
                "efficiency": {"compute": e.compute, "memory": e.memory, "pcie": e.pcie,
                               "step_overhead_ms": e.step_overhead_ms},
                "source": self.source}


def _optional_positive(where: str, key: str, value: object) -> float | None:
    return None if value is None else _positive(where, key, value)


def _positive(where: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def parse_gpu(name: str, entry: object, where: str) -> GpuSpec:
    """One catalog entry -> ``GpuSpec`` (``where`` names the file in errors)."""
    at = f"{where}: GPU {name!r}"
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{at}: expected a mapping of fields, got {type(entry).__name__}")
    unknown = set(entry) - set(_FIELDS)
    if unknown:
        raise ConfigError(f"{at}: unknown field(s) {', '.join(sorted(unknown))}; valid: {', '.join(_FIELDS)}")
    missing = [k for k in _REQUIRED if k not in entry]
    if missing:
        raise ConfigError(f"{at}: missing field(s) {', '.join(missing)}")
    try:
        memory = parse_memory_size(entry["memory"])
    except ConfigError as e:
        raise ConfigError(f"{at}: memory: {e.message if hasattr(e, 'message') else e}") from None
    if memory <= 0:
        raise ConfigError(f"{at}: memory must be positive")
    aliases = entry.get("aliases") or []
    if not isinstance(aliases, list) or not all(isinstance(a, (str, int)) for a in aliases):
        raise ConfigError(f"{at}: aliases must be a list of names")
    eff = entry.get("efficiency") or {}
    if not isinstance(eff, Mapping):
        raise ConfigError(f"{at}: efficiency must be a mapping")
    bad = set(eff) - set(Efficiency.__dataclass_fields__)
    if bad:
        raise ConfigError(f"{at}: unknown efficiency field(s) {', '.join(sorted(bad))};"
                          f" valid: {', '.join(Efficiency.__dataclass_fields__)}")
    try:
        efficiency = Efficiency(**{k: float(v) for k, v in eff.items()})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{at}: {e}") from None
    pcie = _positive(at, "pcie_gbps", entry["pcie_gbps"])
    return GpuSpec(
        name=str(name), memory_bytes=memory,
        memory_bandwidth_gbps=_positive(at, "memory_bandwidth_gbps", entry["memory_bandwidth_gbps"]),
        bf16_tflops=_positive(at, "bf16_tflops", entry["bf16_tflops"]),
        fp8_tflops=_optional_positive(at, "fp8_tflops", entry.get("fp8_tflops")),
        pcie_gbps=pcie, p2p_gbps=_positive(at, "p2p_gbps", entry.get("p2p_gbps", pcie)),
        aliases=tuple(str(a) for a in aliases), efficiency=efficiency, source=str(entry.get("source", "")),
    )


@dataclass(frozen=True)
class Catalog:
    gpus: tuple[GpuSpec, ...]

    @property
    def names(self) -> list[str]:
        return [g.name for g in self.gpus]

    def get(self, name: str) -> GpuSpec:
        key = name.strip().lower()
        for g in self.gpus:
            if key == g.name.lower() or key in (a.lower() for a in g.aliases):
                return g
        raise ConfigError(f"unknown GPU {name!r}; known: {', '.join(self.names)} (add one with --catalog FILE)")

    def merged(self, other: Catalog) -> Catalog:
        """This catalog with ``other``'s entries replacing same-named ones and added after."""
        theirs = {g.name.lower() for g in other.gpus}
        return Catalog(tuple(g for g in self.gpus if g.name.lower() not in theirs) + other.gpus)


def parse_catalog(text: str, where: str) -> Catalog:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {e}") from None
    if not isinstance(doc, Mapping) or not isinstance(doc.get("gpus"), Mapping) or not doc["gpus"]:
        raise ConfigError(f"{where}: expected a top-level 'gpus:' mapping of GPU name -> fields")
    gpus = tuple(parse_gpu(str(n), e, where) for n, e in doc["gpus"].items())
    seen: dict[str, str] = {}
    for g in gpus:
        for key in (g.name, *g.aliases):
            k = key.lower()
            if k in seen and seen[k] != g.name:
                raise ConfigError(f"{where}: name {key!r} of GPU {g.name!r} is already used by {seen[k]!r}")
            seen[k] = g.name
    return Catalog(gpus)


def load_catalog(extra: Path | str | None = None, calibrations: Sequence[Path] | None = None) -> Catalog:
    """The packaged catalog, extended (and overridden by name) with ``extra`` when given, each
    card measured in ``calibrations`` (default: the packaged ``plan/calibrations/*.json``)
    calibrated from its newest run."""
    text = resources.files("chatfleet.plan").joinpath("gpus.yaml").read_text(encoding="utf-8")
    catalog = parse_catalog(text, "gpus.yaml (packaged)")
    if extra is not None:
        path = Path(extra)
        if not path.is_file():
            raise ConfigError(f"GPU catalog {path} does not exist")
        catalog = catalog.merged(parse_catalog(path.read_text(encoding="utf-8"), str(path)))
    return calibrated(catalog, packaged_calibrations() if calibrations is None else calibrations)


def calibrated(catalog: Catalog, calibrations: Sequence[Path]) -> Catalog:
    """``catalog`` with each measured card's memory efficiency and step overhead fitted from its
    newest calibration file (an unknown card fails naming the file)."""
    measured = read_calibration_files(calibrations)
    if not measured:
        return catalog
    by_name: dict[str, MeasuredDecode] = {}
    for m in measured.values():
        try:
            by_name[catalog.get(m.card).name] = m
        except ConfigError as e:
            raise ConfigError(f"calibration {m.source}: {e}") from None
    gpus = []
    for g in catalog.gpus:
        run = by_name.get(g.name)
        if run is not None:
            f = fit(run, g.memory_bandwidth_gbps)
            eff = replace(g.efficiency, memory=f.memory, step_overhead_ms=f.step_overhead_ms)
            g = replace(g, efficiency=eff, calibration=f.describe())
        gpus.append(g)
    return Catalog(tuple(gpus))
