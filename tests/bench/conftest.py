"""Fixtures: the fake OpenAI server in its own process (so its timers and the
client's do not share one event loop)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest


@contextlib.contextmanager
def scripted_server(*args: str):
    proc = subprocess.Popen([sys.executable, "-m", "chatfleet.testing.fake_server", "--port", "0", *args],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"test server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def scripted():
    """Start a scripted server with the given flags: ``url = scripted("--ttft-ms", "20")``."""
    with contextlib.ExitStack() as stack:
        yield lambda *args: stack.enter_context(scripted_server(*args))
