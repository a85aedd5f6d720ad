"""The machine a measurement ran on, in a few words: CPU model, logical CPUs and the load average,
so every demo result says where its numbers come from (torch-free, read from /proc and os)."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class MachineInfo:
    cpu_model: str
    logical_cpus: int
    load_average: tuple[float, float, float]  # 1, 5 and 15 minutes

    def describe(self) -> str:
        one, five, fifteen = self.load_average
        return f"{self.cpu_model}, {self.logical_cpus} CPUs, load average {one:.2f} {five:.2f} {fifteen:.2f}"

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name from /proc/cpuinfo (x86 'model name', Arm 'Model' or 'Hardware');
    else what ``platform`` says; 'unknown CPU' where nothing does."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for key in ("model name", "Model", "Hardware"):
        for line in cpuinfo.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip() == key and value.strip():
                return " ".join(value.split())
    return platform.processor() or platform.machine() or "unknown CPU"


def load_average() -> tuple[float, float, float]:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        nan = float("nan")
        return nan, nan, nan
    return round(one, 2), round(five, 2), round(fifteen, 2)


def machine_info() -> MachineInfo:
    return MachineInfo(cpu_model(), os.cpu_count() or 1, load_average())
