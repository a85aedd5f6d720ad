"""Fixtures: fake replicas and gateways served on loopback in background threads."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import httpx
import pytest

from chatfleet.gateway.app import create_app
from chatfleet.gateway.config import GatewayConfig
from chatfleet.gateway.service import Gateway
from chatfleet.loopback import ServerThread
from chatfleet.testing.fake_server import FakeBehavior, FakeServer


@dataclass
class Fake:
    replica: FakeServer
    server: ServerThread

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def behavior(self) -> FakeBehavior:
        return self.replica.behavior


@dataclass
class GatewayHandle:
    server: ServerThread
    gateway: Gateway

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, **kw) -> httpx.Client:
        # TCP_NODELAY so small writes leave at once (no Nagle delay against delayed ACKs)
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 10.0), transport=transport, **kw)


@pytest.fixture
def fakes():
    made: list[Fake] = []

    def make(n: int = 2, **behavior) -> list[Fake]:
        out = []
        for _ in range(n):
            replica = FakeServer(FakeBehavior(**behavior))
            fake = Fake(replica, ServerThread(replica).start())
            made.append(fake)
            out.append(fake)
        return out

    yield make
    for fake in made:
        fake.server.stop()


@pytest.fixture
def gateways():
    made: list[ServerThread] = []

    def make(urls, **settings) -> GatewayHandle:
        settings.setdefault("health_interval_s", 0.2)
        settings.setdefault("log_requests", False)
        app = create_app(GatewayConfig(replicas=tuple(urls), port=0, **settings))
        server = ServerThread(app).start()
        made.append(server)
        return GatewayHandle(server, app.state.gateway)

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def redis_url(tmp_path):
    """A real redis-server on a free loopback port (Debian: apt-get install redis-server)."""
    import shutil
    import subprocess

    from chatfleet.loopback import free_port

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian package redis-server): shared-state tests skipped")
    pytest.importorskip("redis", reason="redis-py (chatfleet[state]) is not installed")
    import redis

    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        for _ in range(500):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    pytest.fail(f"redis-server exited with {proc.returncode}")
                import time

                time.sleep(0.02)
        else:
            pytest.fail("redis-server did not answer")
        yield url
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
