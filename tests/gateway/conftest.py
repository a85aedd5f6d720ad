"""Fixtures: fake replicas and gateways served on loopback in background threads."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import httpx
import pytest

from chatfleet.gateway.app import create_app
from chatfleet.gateway.service import Gateway
from chatfleet.gateway.config import GatewayConfig
from chatfleet.testing.fake_server import FakeBehavior, FakeServer
from chatfleet.loopback import ServerThread


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
