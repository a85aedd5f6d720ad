"""Which device the engine runs on: ``--device auto|cpu|cuda[:N]``.

Torch-free, so the config validates a name without loading torch (the gateway imports the
config). ``runner/device.py`` resolves a name into the concrete device.
"""

from __future__ import annotations

import re

from chatfleet.errors import ConfigError

DEVICE_NAMES = "auto, cpu, cuda or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> None:
    """A ConfigError unless ``name`` is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    if not _DEVICE.fullmatch(name):
        raise ConfigError(f"unknown device {name!r}; valid: {DEVICE_NAMES}")
