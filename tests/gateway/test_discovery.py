"""Replica discovery against a DNS server and a stub Kubernetes API server, both on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import socket
import threading
from collections.abc import AsyncIterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from dns_helpers import LoopbackDns

from chatfleet.errors import ConfigError
from chatfleet.gateway.discovery import (
    DiscoveredReplicas,
    DnsDiscovery,
    DnsSource,
    K8sSource,
    describe,
    parse_source,
    replica_url,
    slice_urls,
)

# -- parsing and pure parts -------------------------------------------------------------------


def test_parse_sources():
    assert parse_source("dns://engines.ns.svc:8000") == DnsSource("engines.ns.svc", 8000)
    assert parse_source("dns://engines:8000?interval=0.5") == DnsSource("engines", 8000, 0.5)
    assert parse_source("dns://engines:8000?timeout=2&interval=1") == DnsSource("engines", 8000, 1.0, 2.0)
    assert parse_source("k8s://prod/engines") == K8sSource("prod", "engines")
    assert parse_source("k8s://prod/engines:http") == K8sSource("prod", "engines", "http")
    assert str(parse_source("k8s://prod/engines:http")) == "k8s://prod/engines:http"
    for bad in ("dns://engines", "dns://:8000", "dns://e:8000?ttl=3", "dns://e:8000?interval=0", "dns://e:8000?timeout=x",
                "k8s://prod", "k8s://prod/a/b", "http://engines:8000", "engines:8000"):
        with pytest.raises(ConfigError):
            parse_source(bad)


def test_replica_sets_are_sorted_values():
    a = DiscoveredReplicas(("http://10.0.0.2:8000", "http://10.0.0.1:8000", "http://10.0.0.2:8000"), "x")
    assert a.urls == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert a == DiscoveredReplicas(("http://10.0.0.1:8000", "http://10.0.0.2:8000"), "x")
    with pytest.raises(AttributeError):
        a.urls = ()  # type: ignore[misc]
    assert replica_url("fd00::7", 8000) == "http://[fd00::7]:8000"
    assert describe(a, ["http://10.0.0.1:8000", "http://10.0.0.9:8000"]) == \
        "+http://10.0.0.2:8000 -http://10.0.0.9:8000"


def endpoint(address: str, ready: bool | None = True, terminating: bool | None = None) -> dict:
    conditions = {k: v for k, v in (("ready", ready), ("serving", ready), ("terminating", terminating))
                  if v is not None}
    return {"addresses": [address], "conditions": conditions}


def endpoint_slice(name: str, endpoints: list[dict], port: int = 8000, address_type: str = "IPv4",
                   version: str = "1") -> dict:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": address_type,
            "metadata": {"name": name, "namespace": "prod", "resourceVersion": version,
                         "labels": {"kubernetes.io/service-name": "engines"}},
            "ports": [{"name": "metrics", "port": 9100, "protocol": "TCP"},
                      {"name": "http", "port": port, "protocol": "TCP"}],
            "endpoints": endpoints}


def test_slice_urls_honour_ready_and_terminating():
    s = endpoint_slice("a", [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False),
                             endpoint("10.0.0.3", ready=None),  # unset means ready
                             endpoint("10.0.0.4", ready=True, terminating=True)])
    assert slice_urls(s, "http") == ["http://10.0.0.1:8000", "http://10.0.0.3:8000"]
    assert slice_urls(s, None) == ["http://10.0.0.1:9100", "http://10.0.0.3:9100"]  # first port
    assert slice_urls(s, "grpc") == []
    v6 = endpoint_slice("b", [endpoint("fd00::1")], address_type="IPv6")
    assert slice_urls(v6, "http") == ["http://[fd00::1]:8000"]
    assert slice_urls(endpoint_slice("c", [endpoint("engine-0.example")], address_type="FQDN"), "http") == []


class Collector:
    """Consumes a discovery's changes in a task (as the gateway does) and queues each set."""

    def __init__(self, changes: AsyncIterator[DiscoveredReplicas]) -> None:
        self.changes = changes
        self.sets: asyncio.Queue[tuple[str, ...]] = asyncio.Queue()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async for found in self.changes:
            self.sets.put_nowait(found.urls)

    async def take(self, n: int = 1, timeout: float = 20.0) -> list[tuple[str, ...]]:
        return [await asyncio.wait_for(self.sets.get(), timeout) for _ in range(n)]

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


# -- DNS ------------------------------------------------------------------------------------


@pytest.fixture
def loopback_dns():
    server = LoopbackDns()
    yield server
    server.close()


def test_dns_discovery_follows_the_records(loopback_dns):
    loopback_dns.records["engines.prod.svc"] = ["10.0.0.2", "10.0.0.1"]
    discovery = DnsDiscovery(DnsSource("engines.prod.svc", 8000, interval_s=0.05), loopback_dns.resolver())

    async def scenario() -> list[tuple[str, ...]]:
        changes = Collector(discovery.changes())
        seen = await changes.take()
        before = loopback_dns.queries
        while loopback_dns.queries < before + 6:  # several refreshes with the same records: no change
            await asyncio.sleep(0.02)
        loopback_dns.records["engines.prod.svc"] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
        seen += await changes.take()
        loopback_dns.records["engines.prod.svc"] = ["10.0.0.3"]
        seen += await changes.take()
        del loopback_dns.records["engines.prod.svc"]  # no Ready pod left: the name is gone
        seen += await changes.take()
        loopback_dns.records["engines.prod.svc"] = ["10.0.0.4"]
        seen += await changes.take()
        await changes.close()
        return seen

    assert asyncio.run(scenario()) == [
        ("http://10.0.0.1:8000", "http://10.0.0.2:8000"),
        ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"),
        ("http://10.0.0.3:8000",),
        (),
        ("http://10.0.0.4:8000",),
    ]


def test_dns_failure_keeps_the_last_set(loopback_dns):
    """No wall-clock bound to miss on a loaded machine: what happens while the server is silent is
    read after the resolver has given up on several queries (counted at the server)."""
    loopback_dns.records["engines"] = ["10.0.0.1"]
    discovery = DnsDiscovery(DnsSource("engines", 8000, interval_s=0.05, timeout_s=0.5), loopback_dns.resolver())

    async def scenario() -> tuple[list[tuple[str, ...]], DiscoveredReplicas | None, int]:
        changes = Collector(discovery.changes())
        first = await changes.take()
        loopback_dns.silent = True
        failed = await discovery.resolve()
        before = loopback_dns.queries
        while loopback_dns.queries < before + 3:  # query n+1 is sent once query n timed out
            await asyncio.sleep(0.02)
        yielded_while_silent = changes.sets.qsize()  # nothing (no empty set) for the failed lookups
        loopback_dns.records["engines"] = ["10.0.0.5"]
        loopback_dns.silent = False
        later = await changes.take()
        await changes.close()
        return first + later, failed, yielded_while_silent

    seen, failed, yielded_while_silent = asyncio.run(scenario())
    assert failed is None
    assert yielded_while_silent == 0
    assert seen == [("http://10.0.0.1:8000",), ("http://10.0.0.5:8000",)]


# -- Kubernetes -----------------------------------------------------------------------------


class StubKubeApi:
    """EndpointSlice list and watch of one namespace, as the API server serves them.

    ``slices`` is what a list returns; ``push(type, slice)`` sends a watch event to the open watch
    (and updates ``slices``); ``expire()`` makes the next watch answer 410 Gone, so the client must
    list again. Each request's path and query are kept in ``requests``.
    """

    PATH = "/apis/discovery.k8s.io/v1/namespaces/prod/endpointslices"

    def __init__(self) -> None:
        self.slices: dict[str, dict] = {}
        self.version = 1
        self.events: queue.Queue[dict | None] = queue.Queue()
        self.requests: list[tuple[str, dict]] = []
        self.watches = 0
        self.gone = False
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                parts = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
                stub.requests.append((parts.path, query))
                if parts.path != stub.PATH:
                    self.send_error(404)
                    return
                if query.get("watch") in ("true", "True", "1"):
                    stub.watch(self, query)
                else:
                    stub.list(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def list(self, handler: BaseHTTPRequestHandler) -> None:
        body = json.dumps({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                           "metadata": {"resourceVersion": str(self.version)},
                           "items": list(self.slices.values())}).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def watch(self, handler: BaseHTTPRequestHandler, query: dict) -> None:
        self.watches += 1
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        if self.gone:
            self.gone = False
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                      "reason": "Expired", "message": "too old resource version"}
            handler.wfile.write((json.dumps({"type": "ERROR", "object": status}) + "\n").encode())
            return
        deadline = float(query.get("timeoutSeconds", "30"))
        waited = 0.0
        while waited < deadline:
            try:
                event = self.events.get(timeout=0.1)
            except queue.Empty:
                waited += 0.1
                continue
            if event is None:
                return
            handler.wfile.write((json.dumps(event) + "\n").encode())
            handler.wfile.flush()

    def push(self, kind: str, endpoint_slice: dict) -> None:
        self.version += 1
        endpoint_slice = json.loads(json.dumps(endpoint_slice))
        endpoint_slice["metadata"]["resourceVersion"] = str(self.version)
        name = endpoint_slice["metadata"]["name"]
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = endpoint_slice
        self.events.put({"type": kind, "object": endpoint_slice})

    def close(self) -> None:
        self.events.put(None)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def kube_api():
    pytest.importorskip("kubernetes", reason="the kubernetes client (chatfleet[k8s]) is not installed")
    api = StubKubeApi()
    yield api
    api.close()


def k8s_discovery(api: StubKubeApi, port_name: str | None = "http"):
    from chatfleet.gateway.discovery import K8sDiscovery

    return K8sDiscovery(K8sSource("prod", "engines", port_name), api_host=api.url, retry_s=0.1, watch_timeout_s=1)


def test_k8s_discovery_lists_then_watches(kube_api):
    kube_api.slices["engines-a"] = endpoint_slice("engines-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    discovery = k8s_discovery(kube_api)

    async def scenario() -> list[tuple[str, ...]]:
        changes = Collector(discovery.changes())
        seen = await changes.take()
        # 10.0.0.2 goes unready (drains), a new pod joins in a second slice
        kube_api.push("MODIFIED", endpoint_slice("engines-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2", False)]))
        seen += await changes.take()
        kube_api.push("ADDED", endpoint_slice("engines-b", [endpoint("10.0.1.1")]))
        seen += await changes.take()
        kube_api.push("MODIFIED", endpoint_slice("engines-a", [endpoint("10.0.0.1", True, terminating=True)]))
        seen += await changes.take()
        # a slice deleted whose endpoints were all gone already: no change, nothing yielded
        kube_api.push("DELETED", endpoint_slice("engines-a", []))
        kube_api.push("MODIFIED", endpoint_slice("engines-b", [endpoint("10.0.1.1"), endpoint("10.0.1.2")]))
        seen += await changes.take()
        await changes.close()
        return seen

    assert asyncio.run(scenario()) == [
        ("http://10.0.0.1:8000", "http://10.0.0.2:8000"),
        ("http://10.0.0.1:8000",),
        ("http://10.0.0.1:8000", "http://10.0.1.1:8000"),
        ("http://10.0.1.1:8000",),
        ("http://10.0.1.1:8000", "http://10.0.1.2:8000"),
    ]
    lists = [q for path, q in kube_api.requests if q.get("watch") not in ("true", "True", "1")]
    assert lists and all(q["labelSelector"] == "kubernetes.io/service-name=engines" for q in lists)
    watches = [q for path, q in kube_api.requests if q.get("watch") in ("true", "True", "1")]
    assert watches[0]["resourceVersion"] == "1"  # the watch starts where the list ended


def test_k8s_discovery_resumes_expired_watches_and_relists_after_gone(kube_api):
    kube_api.slices["engines-a"] = endpoint_slice("engines-a", [endpoint("10.0.0.1")])
    discovery = k8s_discovery(kube_api)

    async def scenario() -> list[tuple[str, ...]]:
        changes = Collector(discovery.changes())
        seen = await changes.take()
        while kube_api.watches < 2:  # the first watch timed out (1 s) and was resumed
            await asyncio.sleep(0.05)
        kube_api.push("MODIFIED", endpoint_slice("engines-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))
        seen += await changes.take()
        # the next watch answers 410 Gone; meanwhile a change the client never sees as an event
        kube_api.gone = True
        kube_api.slices["engines-a"] = endpoint_slice("engines-a", [endpoint("10.0.0.3")], version="99")
        kube_api.events.put(None)  # end the open watch now
        seen += await changes.take()
        await changes.close()
        return seen

    assert asyncio.run(scenario()) == [
        ("http://10.0.0.1:8000",),
        ("http://10.0.0.1:8000", "http://10.0.0.2:8000"),
        ("http://10.0.0.3:8000",),  # from the list after 410
    ]


def test_k8s_discovery_waits_out_an_unreachable_api_server():
    pytest.importorskip("kubernetes", reason="the kubernetes client (chatfleet[k8s]) is not installed")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    from chatfleet.gateway.discovery import K8sDiscovery

    discovery = K8sDiscovery(K8sSource("prod", "engines"), api_host=f"http://127.0.0.1:{port}", retry_s=0.1)

    async def scenario() -> None:
        changes = Collector(discovery.changes())
        with pytest.raises(TimeoutError):  # no set at all rather than an empty one
            await changes.take(timeout=0.5)
        await changes.close()

    asyncio.run(scenario())
