"""Which machine a benchmark ran on: the CPU (model, vendor, the ISA flags that decide kernel
speed), how many threads the run used, and the load, so every JSON says where its numbers come from.

`describe_machine()` is the block each benchmark writes under "machine"; `native_bf16()` says
whether bfloat16 runs natively here (AVX512_BF16 or AMX), which decides the default dtypes.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

# The flags that change which kernels a CPU runs (and so how fast each dtype is).
FLAGS_THAT_MATTER = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                     "amx_tile", "amx_bf16", "amx_int8")
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _lscpu() -> dict[str, str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = {}
    for line in out.splitlines():
        if ":" in line:
            key, value = line.split(":", 1)
            fields[key.strip()] = value.strip()
    return fields


def _cpuinfo_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_flags() -> set[str]:
    """All the CPU's flags (lscpu's, else /proc/cpuinfo's)."""
    flags = _lscpu().get("Flags")
    return set(flags.split()) if flags else _cpuinfo_flags()


def native_bf16(flags: set[str] | None = None) -> bool:
    """True where the CPU computes bfloat16 natively (AVX512_BF16 or AMX), not by emulation."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def default_dtypes() -> list[str]:
    """float32, plus bfloat16 where the CPU has it natively."""
    return ["float32", "bfloat16"] if native_bf16() else ["float32"]


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def describe_machine(threads_used: int | None = None) -> dict:
    """The CPU, its flags that matter, cores and the threads the run uses, and the load now."""
    info = _lscpu()
    flags = set(info["Flags"].split()) if info.get("Flags") else _cpuinfo_flags()
    import torch

    return {
        "cpu_model": info.get("Model name") or platform.processor(),
        "vendor": info.get("Vendor ID"),
        "architecture": info.get("Architecture") or platform.machine(),
        "cpu_family_model_stepping": [info.get("CPU family"), info.get("Model"), info.get("Stepping")],
        "hypervisor": info.get("Hypervisor vendor"),
        "flags": {f: f in flags for f in FLAGS_THAT_MATTER},
        "native_bf16": native_bf16(flags),
        "logical_cpus": os.cpu_count(),
        "sockets": info.get("Socket(s)"),
        "cores_per_socket": info.get("Core(s) per socket"),
        "threads_per_core": info.get("Thread(s) per core"),
        "l3_cache": info.get("L3 cache"),
        "threads_used": threads_used,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()),
        "platform": platform.platform(),
        "load_average": load_average(),
    }


def one_line(machine: dict) -> str:
    """'Intel(R) Xeon(R) Processor, 2 CPUs, avx512f amx_bf16 ..., load 1.7' for table titles."""
    flags = " ".join(f for f, on in machine["flags"].items() if on) or "no avx2"
    return (f"{machine['cpu_model']}, {machine['logical_cpus']} CPUs ({flags}), "
            f"load {machine['load_average'][0]}")
