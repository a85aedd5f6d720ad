"""Helpers for the gateway tests (imported by name; tests/gateway is on sys.path)."""

from __future__ import annotations

import socket
import time


def dead_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def chat_body(text: str = "hello", stream: bool = False, **extra) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": text}], "stream": stream, **extra}
