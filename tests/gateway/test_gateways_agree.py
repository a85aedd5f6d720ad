"""Two gateways in front of the same replicas, sharing a real Redis (``--state``): the turns of
one conversation alternate between them. Each turn lands on the conversation's home replica,
every later turn is recognised as returning by either gateway (from the request when it carries
earlier turns, through Redis when it carries only a session id), no returning turn is shed as
new, and no replica ever has more than its cap in flight (each gateway enforces cap / 2)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from chatfleet.gateway.routing import HashRing
from chatfleet.gateway.session import body_session
from chatfleet.loopback import ServerThread
from chatfleet.testing.fake_server import FakeBehavior, FakeServer


class PeakServer(FakeServer):
    """A fake replica that counts completion requests in progress and keeps the peak. A request
    counts from its arrival until just before its last byte is sent, so the count never runs
    ahead of the gateway's own (the gateway holds the slot until it has that byte)."""

    def __init__(self, behavior: FakeBehavior) -> None:
        super().__init__(behavior)
        self.now = 0
        self.peak = 0
        self._lock = threading.Lock()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            return await super().__call__(scope, receive, send)
        with self._lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                with self._lock:
                    self.now -= 1

        async def counted_send(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                finish()
            await send(message)

        try:
            await super().__call__(scope, receive, counted_send)
        finally:
            finish()


@pytest.fixture
def peak_replicas():
    made = []

    def make(n: int, **behavior) -> list[tuple[PeakServer, ServerThread]]:
        out = []
        for _ in range(n):
            fake = PeakServer(FakeBehavior(**behavior))
            out.append((fake, ServerThread(fake).start()))
        made.extend(out)
        return out

    yield make
    for _, server in made:
        server.stop()


def history_turns(name: str, turns: int) -> list[tuple[dict, dict]]:
    """A client that resends the whole chat: (body, headers) per turn."""
    messages: list[dict] = [{"role": "system", "content": "be brief"}]
    out = []
    for i in range(turns):
        messages = messages + [{"role": "user", "content": f"{name} turn {i}"}]
        out.append(({"model": "fake", "messages": messages}, {}))
        messages = messages + [{"role": "assistant", "content": f"reply {i}"}]
    return out


def session_turns(name: str, turns: int) -> list[tuple[dict, dict]]:
    """A client that sends only the new message, with a session id."""
    return [({"model": "fake", "messages": [{"role": "user", "content": f"turn {i}"}]}, {"X-Session-ID": name})
            for i in range(turns)]


# health checked once at start, then not while the test runs: a check slowed by a loaded machine
# must not mark a replica down and move its sessions (failover has tests of its own)
STEADY = dict(health_interval_s=600.0, health_timeout_s=30.0, failure_threshold=100)


def key_of(body: dict, headers: dict) -> str:
    return headers.get("X-Session-ID") or body_session(body).key


def test_turns_alternating_between_two_gateways_stay_home_and_stay_returning(
        peak_replicas, gateways, redis_url, caplog):
    (a, ra), (b, rb) = peak_replicas(2, ttft_s=0.005)
    urls = sorted([ra.url, rb.url])
    settings = dict(state=redis_url, gateways=2, max_in_flight=8, load_factor=4.0, log_requests=True, **STEADY)
    pair = [gateways(urls, **settings), gateways(urls, **settings)]
    conversations = {f"h{i}": history_turns(f"h{i}", 4) for i in range(6)}
    conversations |= {f"s{i}": session_turns(f"s{i}", 4) for i in range(6)}
    clients = [g.client(timeout=30) for g in pair]
    landed: dict[str, list[str]] = {}
    request_turn: dict[str, int] = {}

    def talk(name: str) -> None:
        start = sorted(conversations).index(name) % 2
        for i, (body, headers) in enumerate(conversations[name]):
            request_id = f"{name}-{i}"
            request_turn[request_id] = i
            r = clients[(start + i) % 2].post("/v1/chat/completions", json=body,
                                              headers={**headers, "X-Request-ID": request_id})
            assert r.status_code == 200, r.text
            landed.setdefault(name, []).append(r.headers["x-chatfleet-replica"])

    caplog.set_level(logging.INFO, logger="chatfleet.gateway")
    # at most 4 requests at once: no cap or load bound is reached, so every turn goes home
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(talk, conversations))
    for c in clients:
        c.close()
    ring = HashRing(urls)
    for name, turns in conversations.items():
        home = ring.home(key_of(*turns[0]))
        assert landed[name] == [home] * len(turns), name
    # a gateway writes a request's log line after the response's last byte, so the client can
    # hold its last replies before their lines exist: wait for them (bounded), then judge
    deadline = time.monotonic() + 30.0
    while True:
        verdicts = {r.request_id: r.returning for r in caplog.records
                    if r.getMessage() == "request" and getattr(r, "request_id", "") in request_turn}
        if len(verdicts) == len(request_turn) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert len(verdicts) == len(request_turn)
    assert {rid: request_turn[rid] > 0 for rid in verdicts} == verdicts, "a turn's returning verdict is wrong"


def test_caps_hold_across_gateways_and_returning_turns_are_never_shed(peak_replicas, gateways, redis_url):
    cap = 2
    replicas = peak_replicas(2, ttft_s=0.3, tokens=2)
    urls = sorted(server.url for _, server in replicas)
    # each gateway: cap // 2 = 1 per replica; first turns never wait (shed at once when full),
    # returning turns wait for a slot
    settings = dict(state=redis_url, gateways=2, max_in_flight=cap, max_queued_new=0, max_queue_wait_s=120.0,
                    **STEADY)
    pair = [gateways(urls, **settings), gateways(urls, **settings)]
    names = [f"c{i}" for i in range(10)]
    conversations = {n: (history_turns if i % 2 else session_turns)(n, 3) for i, n in enumerate(names)}
    shed_first: list[str] = []
    shed_returning: list[str] = []
    go = threading.Barrier(len(names))

    def talk(name: str) -> None:
        start = names.index(name) % 2
        with httpx.Client(base_url=pair[0].url, timeout=120) as c0, httpx.Client(base_url=pair[1].url,
                                                                                 timeout=120) as c1:
            clients = (c0, c1)
            go.wait()
            for i, (body, headers) in enumerate(conversations[name]):
                while True:
                    r = clients[(start + i) % 2].post("/v1/chat/completions", json=body, headers=headers)
                    if r.status_code != 429:
                        break
                    (shed_returning if i > 0 else shed_first).append(f"{name}-{i}")
                assert r.status_code == 200, r.text

    threads = [threading.Thread(target=talk, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    assert shed_returning == [], "returning turns were shed as new"
    assert shed_first, "no first turn was shed: the caps were never reached, nothing was tested"
    assert all(fake.peak <= cap for fake, _ in replicas), [fake.peak for fake, _ in replicas]
    assert sum(len(fake.stats.requests) for fake, _ in replicas) >= 3 * len(names)


def test_an_unreachable_redis_falls_back_to_the_gateways_own_memory():
    import asyncio

    from gateway_helpers import dead_url

    from chatfleet.gateway.fleet_state import Conversations
    from chatfleet.gateway.session_tracker import SessionTracker

    async def scenario() -> tuple[bool, bool, bool]:
        conversations = Conversations(SessionTracker(60.0, 100), dead_url().replace("http", "redis"))
        try:
            unknown = await conversations.is_returning("a")  # Redis refuses: new, no exception
            await conversations.admitted("a")
            return unknown, await conversations.is_returning("a"), await conversations.is_returning("b")
        finally:
            await conversations.close()

    assert asyncio.run(scenario()) == (False, True, False)
