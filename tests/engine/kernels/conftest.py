"""Kernel tests: Triton kernels run in the interpreter on CPU (``TRITON_INTERPRET=1``, set here
before any kernel module is imported) and compiled on a GPU in the ``cuda``-marked tests."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when @triton.jit decorates a kernel


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped with the reason where there is none)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="no CUDA device: GPU-only kernel check")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
