"""`--replicas-from dns://...` wired into the gateway: a DNS server and fake replicas on loopback
addresses (127.0.0.x, one port for all, as the pods of a headless Service).

New replicas join the ring (each session lands where the ring of the current set says), removed
ones drain: their in-flight stream finishes whole, no new request goes there, and they are
forgotten once idle."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
from dns_helpers import LoopbackDns
from gateway_helpers import chat_body, wait_for

from chatfleet.gateway.app import create_app
from chatfleet.gateway.config import GatewayConfig
from chatfleet.gateway.discovery import DnsDiscovery, DnsSource
from chatfleet.gateway.routing import HashRing
from chatfleet.loopback import ServerThread
from chatfleet.testing.fake_server import FakeBehavior, FakeServer

NAME = "engines.prod.svc"
HOSTS = ("127.0.0.11", "127.0.0.12", "127.0.0.13")


def _one_port_on(hosts) -> int:
    """A port free on every host (the Service's targetPort)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError("no port free on all loopback hosts")


@pytest.fixture
def fleet():
    dns = LoopbackDns()
    port = _one_port_on(HOSTS)
    fakes = {}
    servers = []
    for host in HOSTS:
        fake = FakeServer(FakeBehavior(tokens=4))
        servers.append(ServerThread(fake, host=host, port=port).start())
        fakes[f"http://{host}:{port}"] = fake
    made = []

    def gateway(**settings):
        discovery = DnsDiscovery(DnsSource(NAME, port, interval_s=0.05), dns.resolver())
        app = create_app(GatewayConfig(port=0, health_interval_s=0.2, log_requests=False,
                                       replicas_from=f"dns://{NAME}:{port}", **settings), discovery=discovery)
        server = ServerThread(app).start()
        made.append(server)
        return server, app.state.gateway

    yield dns, fakes, gateway
    for server in made + servers:
        server.stop()
    dns.close()


def status(url: str) -> dict:
    return httpx.get(url + "/gateway/status", timeout=10).json()


def routable(url: str) -> set[str]:
    return {r["url"] for r in status(url)["replicas"] if r["healthy"] and not r["draining"]}


def turn(client: httpx.Client, session: str) -> str:
    r = client.post("/v1/chat/completions", json=chat_body(session), headers={"X-Session-ID": session})
    assert r.status_code == 200, r.text
    return r.headers["x-chatfleet-replica"]


SESSIONS = [f"s{i}" for i in range(40)]


def test_replicas_join_the_ring_and_removed_ones_drain(fleet):
    dns, fakes, make_gateway = fleet
    urls = sorted(fakes)
    dns.records[NAME] = [h for h in HOSTS[:2]]
    server, _ = make_gateway()
    wait_for(lambda: routable(server.url) == set(urls[:2]), what="the first two replicas")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        # one request at a time: every session is under its load bound, so at its home
        placed = {s: turn(client, s) for s in SESSIONS}
        assert placed == {s: HashRing(urls[:2]).home(s) for s in SESSIONS}

        dns.records[NAME] = list(HOSTS)  # a third pod became ready
        wait_for(lambda: routable(server.url) == set(urls), what="the third replica to join")
        placed = {s: turn(client, s) for s in SESSIONS}
        assert placed == {s: HashRing(urls).home(s) for s in SESSIONS}
        assert set(placed.values()) == set(urls)  # the newcomer took its share

        # a stream in flight on the replica about to leave, held chunk by chunk
        leaving = placed[SESSIONS[0]]
        fakes[leaving].behavior.step = True
        fakes[leaving].behavior.tokens = 6
        events: list[str] = []

        def stream() -> None:
            with client.stream("POST", "/v1/chat/completions", json=chat_body(SESSIONS[0], stream=True),
                               headers={"X-Session-ID": SESSIONS[0]}) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: fakes[leaving].stats.active == 1, what="the stream to start")
        dns.records[NAME] = [h for h in HOSTS if f"http://{h}:" not in leaving]
        wait_for(lambda: any(r["draining"] for r in status(server.url)["replicas"]), what="the drain")
        before = len(fakes[leaving].stats.requests)
        placed = {s: turn(client, s) for s in SESSIONS}  # while the stream still runs there
        rest = sorted(set(urls) - {leaving})
        assert placed == {s: HashRing(rest).home(s) for s in SESSIONS}
        assert len(fakes[leaving].stats.requests) == before, "a new request went to a draining replica"
        assert leaving in {r["url"] for r in status(server.url)["replicas"]}, "forgotten while busy"
        fakes[leaving].step(100)
        reader.join(30)
        assert not reader.is_alive()
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events), events
        pieces = [json.loads(e[6:]) for e in events[:-1]]
        assert sum(1 for p in pieces for c in p.get("choices", []) if c["delta"].get("content")) == 6
        wait_for(lambda: leaving not in {r["url"] for r in status(server.url)["replicas"]},
                 what="the drained replica to be forgotten")


def test_an_empty_set_answers_no_replica_then_the_fleet_appears(fleet):
    dns, fakes, make_gateway = fleet
    server, _ = make_gateway()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        wait_for(lambda: dns.queries >= 2, what="discovery to ask")
        assert client.get("/health").status_code == 503
        r = client.post("/v1/chat/completions", json=chat_body("x"))
        assert r.status_code == 503 and r.json()["error"]
        dns.records[NAME] = [HOSTS[0]]
        wait_for(lambda: len(routable(server.url)) == 1, what="a replica")
        assert turn(client, "x") == sorted(fakes)[0]
