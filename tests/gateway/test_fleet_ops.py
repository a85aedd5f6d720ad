"""Fleet operations through the gateway: the prefix-cache reset of every replica (admin key),
``GET /v1/models/{id}`` and ``/tokenize`` passed through, and ``/metrics`` naming the replicas'."""

from __future__ import annotations

import httpx
import pytest
from gateway_helpers import dead_url, wait_for
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from chatfleet.loopback import ServerThread

PROBE = {"model": "fake", "max_tokens": 1, "messages": [
    {"role": "system", "content": " ".join(f"word{i}" for i in range(64))}, {"role": "user", "content": "ok"}]}


def cached(client: httpx.Client, **kw) -> int:
    r = client.post("/v1/chat/completions", json=PROBE, **kw)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_reset_empties_every_replica_and_reports_each(fakes, gateways):
    a, b = fakes(2)
    gw = gateways([a.url, b.url])
    with gw.client() as client:
        for fake in (a, b):  # each replica caches the probe (sent to each directly)
            with httpx.Client(base_url=fake.url) as direct:
                direct.post("/v1/chat/completions", json=PROBE)
                assert cached(direct) > 0
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["success"] is True
        assert [(x["url"], x["success"], x["status"]) for x in report["replicas"]] == \
            [(u, True, 200) for u in sorted([a.url, b.url])]
        for fake in (a, b):
            with httpx.Client(base_url=fake.url) as direct:
                assert cached(direct) == 0


def test_a_replica_that_cannot_be_reset_is_named(fakes, gateways):
    (a,) = fakes(1)
    down = dead_url()
    gw = gateways([a.url, down])
    with gw.client() as client:
        r = client.post("/reset_prefix_cache")
    assert r.status_code == 502
    report = {x["url"]: x for x in r.json()["replicas"]}
    assert r.json()["success"] is False
    assert report[a.url]["success"] is True
    assert report[down]["success"] is False and report[down]["error"]


def test_reset_needs_the_admin_key_once_keys_are_set(fakes, gateways):
    (a,) = fakes(1)
    closed = gateways([a.url], api_keys=("tenant",))
    with closed.client() as client:
        assert client.post("/reset_prefix_cache", headers={"authorization": "Bearer tenant"}).status_code == 401
    admin = gateways([a.url], api_keys=("tenant",), admin_api_keys=("root",))
    with admin.client() as client:
        assert client.post("/reset_prefix_cache", headers={"authorization": "Bearer tenant"}).status_code == 401
        assert client.post("/reset_prefix_cache").status_code == 401
        assert client.post("/reset_prefix_cache", headers={"authorization": "Bearer root"}).status_code == 200
        # the admin key is a tenant key too (a sweep runs with one key)
        assert cached(client, headers={"authorization": "Bearer root"}) >= 0


def _replica_app(seen: list[tuple[str, str | None]]) -> Starlette:
    """A replica with the pass-through routes, recording what reached it."""

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "m1", "object": "model"}]})

    async def model(request: Request) -> JSONResponse:
        seen.append((request.url.path, request.headers.get("authorization")))
        name = request.path_params["name"]
        if name != "m1":
            return JSONResponse({"error": {"message": f"no model {name}", "type": "not_found"}}, status_code=404)
        return JSONResponse({"id": "m1", "object": "model", "owned_by": "replica"})

    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append((request.url.path, request.headers.get("authorization")))
        tokens = [len(w) for w in body["prompt"].split()]
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": 128})

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/models/{name:path}", model), Route("/tokenize", tokenize, methods=["POST"])])


@pytest.fixture
def plain_replica():
    seen: list[tuple[str, str | None]] = []
    server = ServerThread(_replica_app(seen)).start()
    yield server, seen
    server.stop()


def test_model_and_tokenize_pass_through(plain_replica, gateways):
    server, seen = plain_replica
    gw = gateways([server.url], api_keys=("k",), upstream_api_key="upstream")
    auth = {"authorization": "Bearer k"}
    with gw.client() as client:
        wait_for(lambda: client.get("/v1/models", headers=auth).json()["data"], what="models")
        r = client.get("/v1/models/m1", headers=auth)
        assert r.status_code == 200 and r.json() == {"id": "m1", "object": "model", "owned_by": "replica"}
        assert r.headers["x-chatfleet-replica"] == server.url
        assert client.get("/v1/models/nope", headers=auth).status_code == 404  # the replica's own answer
        r = client.post("/tokenize", json={"model": "m1", "prompt": "a bb ccc"}, headers=auth)
        assert r.status_code == 200 and r.json()["tokens"] == [1, 2, 3]
        assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401  # gateway keys apply
    assert seen == [("/v1/models/m1", "Bearer upstream"), ("/v1/models/nope", "Bearer upstream"),
                    ("/tokenize", "Bearer upstream")]


def test_metrics_keep_the_gateways_series_and_name_the_replicas(fakes, gateways):
    a, b = fakes(2)
    gw = gateways([a.url, b.url])
    with gw.client() as client:
        text = client.get("/metrics").text
        targets = client.get("/gateway/targets").json()
    assert "chatfleet:gateway_in_flight" in text and "chatfleet:gateway_requests_total" in text
    comments = [line for line in text.splitlines() if line.startswith("#   ")]
    assert comments == [f"#   {u}/metrics" for u in sorted([a.url, b.url])]
    assert targets == [{"targets": sorted(u.removeprefix("http://") for u in (a.url, b.url)),
                        "labels": {"job": "chatfleet-engine", "__metrics_path__": "/metrics"}}]
    from prometheus_client.parser import text_string_to_metric_families

    names = {family.name for family in text_string_to_metric_families(text)}  # the comments parse away
    assert "chatfleet:gateway_in_flight" in names
