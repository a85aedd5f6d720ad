"""The ``cuda`` marker for the engine's tests: GPU-only checks, skipped with their reason (shown
by ``-ra``) where torch sees no CUDA device."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped with the reason where there is none)")
