"""Hostile input at the gateway: the malformed-request corpus, every schemathesis check against
the gateway's OpenAPI document (bounded examples), large bodies, and the engine and the gateway
in front of it refusing the same input alike. Client input never gives a 5xx, never counts
against a replica, and both the gateway and its replicas stay healthy; a running stream keeps
flowing meanwhile."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from gateway_helpers import chat_body, wait_for

from chatfleet.gateway.app import create_app
from chatfleet.gateway.config import GatewayConfig
from chatfleet.testing.openapi_checks import operation_paths, schemathesis_failures

CORPUS = json.loads((Path(__file__).parents[1] / "data" / "malformed_requests.json").read_text())["cases"]


def raw_body(case: dict) -> bytes:
    if "body_hex" in case:
        return bytes.fromhex(case["body_hex"])
    if "body" in case:
        return case["body"].encode()
    return "".join(text * times for text, times in case["parts"]).encode()


def assert_all_healthy(gw, fakes) -> None:
    with gw.client() as client:
        assert client.get("/health").json()["healthy_replicas"] == len(fakes)
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    for fake in fakes:
        state = gw.gateway.replicas[fake.url]
        assert state.healthy and state.stats.upstream_errors == 0 and state.stats.marked_down == 0


def test_malformed_corpus_gets_client_errors_only(fakes, gateways):
    replicas = fakes(2)
    gw = gateways([f.url for f in replicas])
    wrong = []
    with gw.client() as client:
        for case in CORPUS:
            r = client.post(case["path"], content=raw_body(case), headers={"content-type": "application/json"})
            ok = {"400": r.status_code == 400, "4xx": 400 <= r.status_code < 500,
                  "4xx_or_2xx": r.status_code < 300 or 400 <= r.status_code < 500}[case["expect"]]
            if not ok:
                wrong.append((case["name"], r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                assert r.json()["error"]["message"], case["name"]
    assert not wrong
    assert_all_healthy(gw, replicas)


EXAMPLES = 8  # per operation and generation mode: bounded, the whole run stays within seconds


@pytest.fixture(scope="module")
def fuzzed_fleet():
    from chatfleet.loopback import ServerThread
    from chatfleet.testing.fake_server import FakeBehavior, FakeServer

    replicas = [ServerThread(FakeServer(FakeBehavior(), record=False)).start() for _ in range(2)]
    app = create_app(GatewayConfig(replicas=tuple(s.url for s in replicas), port=0, health_interval_s=0.2,
                                   log_requests=False))
    gateway = ServerThread(app).start()
    wait_for(lambda: len(app.state.gateway.replicas.healthy()) == 2, what="the replicas to be healthy")
    yield gateway, app.state.gateway
    gateway.stop()
    for server in replicas:
        server.stop()


def test_every_schemathesis_check_passes_on_every_gateway_operation(fuzzed_fleet):
    """The gateway's OpenAPI document matches its behaviour: every schemathesis check (status codes
    and content types as documented, bodies against their schemas, valid data accepted, invalid
    data refused, Allow on 405...), positive and negative, bounded examples per operation; no
    client input counts against a replica."""
    server, gateway = fuzzed_fleet
    assert operation_paths(server.url) >= {"/v1/chat/completions", "/v1/completions", "/health", "/metrics"}
    failures = schemathesis_failures(server.url, EXAMPLES, timeout=30)
    assert not failures, "\n".join(failures[:40])
    assert all(r.healthy and r.stats.upstream_errors == 0 for r in gateway.replicas.replicas.values())


def test_a_stream_keeps_flowing_while_large_bodies_are_refused(fakes, gateways):
    (fake,) = fakes(1, interval_s=0.005)
    gw = gateways([fake.url], max_body_bytes=8 << 20, body_offload_bytes=256 << 10)
    arrivals: list[float] = []
    ended: list[str] = []

    def consume():
        with gw.client(timeout=30.0) as client, client.stream(
                "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=1000)) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append(time.monotonic())
                    if line == "data: [DONE]":
                        ended.append(line)

    reader = threading.Thread(target=consume)
    reader.start()
    wait_for(lambda: len(arrivals) >= 3, what="the stream to start")
    big = "word " * (1_600_000 - 10)  # ~7.8 MB of chat: under the limit, validated off the loop
    statuses = []
    start = time.monotonic()
    with gw.client(timeout=60.0) as client:
        too_big = b'{"model": "fake", "messages": []}' + b" " * (9 << 20)
        statuses.append(client.post("/v1/chat/completions", content=too_big).status_code)
        statuses.append(client.post("/v1/chat/completions", content=iter([too_big[i:i + (1 << 20)]
                                    for i in range(0, len(too_big), 1 << 20)])).status_code)  # chunked
        statuses.append(client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "nobody", "content": big[: 1 << 20]}]}).status_code)
        statuses.append(client.post("/v1/chat/completions", json=chat_body(big, max_tokens=2)).status_code)
    end = time.monotonic()
    reader.join(60)
    assert statuses == [413, 413, 400, 200]
    assert ended, "the running stream did not finish"
    assert any(start < t < end for t in arrivals), "no chunk reached the client while the bodies were handled"
    state = gw.gateway.replicas[fake.url]
    assert state.healthy and state.stats.upstream_errors == 0 and state.stats.marked_down == 0


# -- the engine and the gateway in front of it refuse the same input alike ---------------------

@pytest.fixture(scope="module")
def engine_and_gateway():
    """A tiny built-in engine on loopback and a gateway in front of it."""
    import torch

    from chatfleet.engine.api.async_engine import AsyncEngine
    from chatfleet.engine.api.server import build_app
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.config import CacheConfig, EngineConfig
    from chatfleet.engine.engine import Engine
    from chatfleet.engine.models.loader import load_model
    from chatfleet.engine.runner.torch_runner import TorchRunner
    from chatfleet.loopback import ServerThread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(resolve_model("tiny"), dtype="float32")
    config = EngineConfig(model="tiny", max_model_len=256, cache=CacheConfig(block_size=16, num_tokens=1024))
    engine = AsyncEngine(Engine(config, runner=TorchRunner(loaded, 64, 16), tokenizer=loaded.tokenizer))
    with ServerThread(build_app(engine)) as engine_server:
        app = create_app(GatewayConfig(replicas=(engine_server.url,), port=0, health_interval_s=0.2,
                                       log_requests=False))
        gateway = ServerThread(app).start()
        try:
            wait_for(lambda: app.state.gateway.replicas.healthy(), what="the engine to be healthy")
            yield engine_server.url, gateway.url, engine.model_name
        finally:
            gateway.stop()
    torch.set_num_threads(threads)


def post_to_both(urls, path: str, body: bytes, headers: dict[str, str]):
    import httpx

    engine_url, gateway_url, _ = urls
    return [httpx.post(url + path, content=body, headers=headers, timeout=60) for url in (engine_url, gateway_url)]


CONTENT_TYPES = [  # (content type, accepted)
    (None, True), ("application/json", True), ("application/json; charset=utf-8", True),
    ("Application/JSON", True), ("application/vnd.api+json", True),
    ("text/plain", False), ("application/x-www-form-urlencoded", False), ("multipart/form-data; boundary=x", False),
    ("application/xml", False), ("text/json-ish", False), ("", True),  # an empty header: none sent
]


@pytest.mark.parametrize("content_type, accepted", CONTENT_TYPES)
def test_engine_and_gateway_judge_content_types_alike(engine_and_gateway, content_type, accepted):
    model = engine_and_gateway[2]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    headers = {} if content_type is None else {"content-type": content_type}
    engine, gateway = post_to_both(engine_and_gateway, "/v1/chat/completions", body, headers)
    assert engine.status_code == gateway.status_code == (200 if accepted else 400), (engine.text, gateway.text)
    if not accepted:
        for r in (engine, gateway):
            message = r.json()["error"]["message"]
            assert "content type" in message and repr(content_type) in message, message


def test_engine_and_gateway_refuse_hostile_bodies_alike(engine_and_gateway):
    """Every case of the malformed corpus, sent to the engine and through the gateway: the same
    status, and a refusal names the same field (in its message and as ``param``)."""
    model = engine_and_gateway[2]
    differ, refused = [], 0
    for case in CORPUS:
        body = raw_body(case).replace(b'"model": "fake"', f'"model": "{model}"'.encode()).replace(
            b'"model":"fake"', f'"model":"{model}"'.encode())
        if b'"max_tokens"' not in body and body.startswith(b"{") and len(body) < 1 << 16:
            body = body.replace(b"{", b'{"max_tokens": 2, ', 1)  # keep the valid ones short
        engine, gateway = post_to_both(engine_and_gateway, case["path"], body, {"content-type": "application/json"})
        if engine.status_code != gateway.status_code:
            differ.append((case["name"], engine.status_code, gateway.status_code, engine.text[:150],
                           gateway.text[:150]))
            continue
        if engine.status_code == 400:
            refused += 1
            errors = [r.json()["error"] for r in (engine, gateway)]
            params = [e["param"] for e in errors]
            named = all(e["param"] is None or e["param"] in e["message"] for e in errors)
            internal = any(word in e["message"] for e in errors for word in ("Python", "Traceback", "int_max_str"))
            if params[0] != params[1] or not named or internal:
                differ.append((case["name"], *[e["message"][:150] for e in errors]))
    assert not differ, "\n".join(map(str, differ))
    assert refused > len(CORPUS) // 2, refused
