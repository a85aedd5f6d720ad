"""The concrete device a ``--device`` name means on this machine (``auto``: the current CUDA
device when torch sees one, else the CPU); a CUDA device asked for and absent fails with one
line. A CPU install never touches CUDA: ``auto`` only asks torch whether a GPU is there."""

from __future__ import annotations

import torch

from chatfleet.engine.device import check_device_name
from chatfleet.errors import ConfigError


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means on this machine (``auto``: CUDA when present, else the CPU)."""
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: torch sees no CUDA device here (use --device cpu or auto)")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", index)
    return device


def resolve_device_name(name: str) -> str:
    """``resolve_device`` as a string (``"cpu"``, ``"cuda:0"``)."""
    return str(resolve_device(name))
