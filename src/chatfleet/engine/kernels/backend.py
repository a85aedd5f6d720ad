"""Which implementation a kernel call runs: the Triton kernel or its torch reference.

Every kernel of this package has a torch reference (the code the engine runs today, reused
where it exists) and a Triton kernel. ``resolve_backend`` picks one per call:

- ``"torch"``: always the reference;
- ``"triton"``: always the kernel (on CPU tensors only under ``TRITON_INTERPRET=1``, the
  interpreter the tests use); raises ``KernelUnsupported`` where it cannot run;
- ``"auto"``: the kernel when Triton is installed, every tensor is on a CUDA device and the
  call's shapes and dtypes are ones the kernel supports; the reference otherwise (CPU tensors
  always take the reference, interpreter or not).

``CHATFLEET_KERNELS=torch`` in the environment turns ``auto`` into ``torch`` (a switch for
bisecting a wrong output on a GPU without editing code).
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import torch

from chatfleet.errors import ConfigError

BACKENDS = ("auto", "torch", "triton")
ENV_OVERRIDE = "CHATFLEET_KERNELS"


class KernelUnsupported(ConfigError):
    """A forced ``triton`` backend cannot run this call (no Triton, a CPU tensor, a dtype or shape)."""


@lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (imported lazily, only by the kernels)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (``TRITON_INTERPRET=1``: CPU tensors work)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def reference_forced() -> bool:
    """Whether ``CHATFLEET_KERNELS=torch`` asks every ``auto`` call for the reference."""
    return os.environ.get(ENV_OVERRIDE) == "torch"


def resolve_backend(requested: str, tensors: tuple[torch.Tensor, ...], why_not: str | None = None) -> str:
    """``"torch"`` or ``"triton"`` for a call on ``tensors``.

    ``why_not``: the kernel's own reason it cannot take this call (a dtype or shape it does not
    support), None when it can.
    """
    if requested not in BACKENDS:
        raise ConfigError(f"unknown kernel backend {requested!r}; valid: {', '.join(BACKENDS)}")
    if requested == "torch":
        return "torch"
    if requested == "auto" and reference_forced():
        return "torch"
    reason = why_not
    if reason is None and not triton_available():
        reason = "triton is not installed"
    on_cuda = all(t.is_cuda for t in tensors)
    if reason is None and not on_cuda and (requested == "auto" or not interpreting()):
        reason = "tensors are not on a CUDA device (a forced triton backend interprets CPU tensors"
        reason += " under TRITON_INTERPRET=1)"
    if reason is None:
        return "triton"
    if requested == "triton":
        raise KernelUnsupported(f"triton kernel unavailable: {reason}")
    return "torch"


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
