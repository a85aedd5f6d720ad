"""Serve on loopback: a free port, and an ASGI app on a background thread (tests, demos, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for servers started in another process)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerThread:
    """Run an ASGI app with uvicorn in a daemon thread. ``port=0``: any free port.

    The socket is bound here, before the thread starts, so ``url`` is known at once and no other
    process can take the port in between.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **uvicorn_kw: Any) -> None:
        # proto=IPPROTO_TCP so asyncio sets TCP_NODELAY on accepted connections (else +40 ms).
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host = host
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        kw: dict[str, Any] = {"log_level": "warning", "access_log": False, "lifespan": "on", "backlog": 8192}
        kw.update(uvicorn_kw)
        self.server = uvicorn.Server(uvicorn.Config(app, **kw))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="chatfleet-server", daemon=True
        )

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
