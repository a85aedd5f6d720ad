"""Does a KV pool fit the memory this machine (or GPU) has free? Checked before allocating.

A CPU pool is allocated lazily (pages appear as blocks are written), so a pool larger than the
machine starts fine and then eats memory until the kernel kills something; a GPU pool fails
deep inside torch. Both get one clear line instead, before any allocation: host memory from
``MemAvailable`` in ``/proc/meminfo`` (memory the kernel can hand out without swapping), GPU
memory from ``torch.cuda.mem_get_info``. Where neither can be read, nothing is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from chatfleet.errors import ConfigError

GiB = 1 << 30
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class FreeMemory:
    free_bytes: int
    total_bytes: int
    where: str  # "host" or "cuda:0"


def host_memory(meminfo: Path = MEMINFO) -> FreeMemory | None:
    """Available and total host memory, from /proc/meminfo (None where it cannot be read)."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        free = int(fields["MemAvailable"].split()[0]) * 1024
        total = int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return FreeMemory(free, total, "host")


def device_memory(device: str) -> FreeMemory | None:
    """Free and total memory of ``device``: the host for CPU, the GPU's own for CUDA (``auto``:
    whichever ``engine/device.py`` resolves it to)."""
    if device == "auto":
        from chatfleet.engine.runner.device import resolve_device_name

        device = resolve_device_name(device)
    if not device.startswith("cuda"):
        return host_memory()
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return FreeMemory(free, total, str(torch.device(device)))


def check_fits(num_bytes: int, what: str, flag: str, memory: FreeMemory | None) -> None:
    """Raise a one-line ConfigError if ``num_bytes`` of ``what`` exceed ``memory``'s free bytes."""
    if memory is None or num_bytes <= memory.free_bytes:
        return
    where = "this machine" if memory.where == "host" else memory.where
    raise ConfigError(f"{what} of {num_bytes / GiB:.1f} GiB does not fit: {where} has "
                      f"{memory.free_bytes / GiB:.1f} GiB free of {memory.total_bytes / GiB:.1f} GiB; "
                      f"lower {flag}")


def check_kv_fits(device_pool_bytes: int, host_pool_bytes: int, device: str) -> None:
    """The device KV pool against the device's free memory, the host tier against the host's."""
    check_fits(device_pool_bytes, "the KV cache", "--kv-cache-memory or --kv-cache-tokens", device_memory(device))
    if host_pool_bytes:
        if device == "auto":
            from chatfleet.engine.runner.device import resolve_device_name

            device = resolve_device_name(device)
        host = host_memory()
        if not device.startswith("cuda") and host is not None:  # both pools live on the host
            host = FreeMemory(host.free_bytes - device_pool_bytes, host.total_bytes, "host")
        check_fits(host_pool_bytes, "the host KV tier", "--host-cache-memory", host)
