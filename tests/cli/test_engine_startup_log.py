"""`chatfleet engine` logs its memory table and KV pool on the console at start-up (as the
README says), at --log-level info by default, and not at --log-level warning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from chatfleet.loopback import free_port


def startup_output(*flags: str) -> str:
    """The engine's console output from start until it answers /health (then it is stopped)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "chatfleet.cli.main", "engine", "--model", "tiny", "--port",
                             str(port), "--threads", "1", "--kv-cache-tokens", "2048", *flags],
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(1200):  # a hang guard (up to ~2 minutes), not a timing check
            if proc.poll() is not None:
                break
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    return out


def test_the_memory_table_and_the_pool_are_on_the_console_by_default():
    out = startup_output()
    if "Application startup complete" not in out:
        pytest.fail(f"the engine did not start:\n{out}")
    assert "INFO:     Memory: qwen3" in out
    assert "weights" in out and "B/token" in out  # the memory table: tensor classes, bytes per token
    assert "KV pool: 2,048 tokens" in out and "MiB" in out  # the pool: tokens and bytes
    assert out.index("KV pool") < out.index("Application startup complete")


def test_log_level_warning_leaves_only_warnings():
    out = startup_output("--log-level", "warning")
    assert "Traceback" not in out and "KV pool" not in out and "Memory:" not in out
