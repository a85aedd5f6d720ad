"""Shared checks for the kernel tests: whether Triton kernels can run here, and how (the
conftest beside this file has set ``TRITON_INTERPRET`` before any test module imports this)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"

needs_interpreter = pytest.mark.skipif(
    not HAS_TRITON or not INTERPRETING,
    reason="triton is not installed" if not HAS_TRITON else "TRITON_INTERPRET is not 1 (a CUDA device is present: "
    "the cuda-marked tests run the compiled kernels)")
needs_cuda_triton = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA device and triton")


def fp8_grid_values(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` random finite e4m3 values (every code equally likely) as float32."""
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    values = codes.view(torch.float8_e4m3fn).float()
    values = values[values.isfinite()]
    return values[torch.randint(len(values), (n,), generator=generator)]
