"""No client input gets a 5xx from the engine: a malformed-input corpus and a bounded schemathesis
run against the engine's own /openapi.json; the server is healthy and empty afterwards."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.api.server import build_app
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.loopback import ServerThread

SPEC = json.loads((Path(__file__).parent / "data" / "malformed_requests.json").read_text())
PLACEHOLDER = "__FRAGMENT__"
BODY_ROUTES = ("/v1/chat/completions", "/v1/completions", "/tokenize")


def fragment(text: str) -> str:
    kind, _, n = text.partition(":")
    if kind == "deep":
        return "[" * int(n) + "]" * int(n)
    if kind == "digits":
        return "9" * int(n)
    if kind == "text":
        return json.dumps("x" * int(n))
    return text


def with_fragment(base: dict, path: tuple, frag: str) -> bytes:
    body = json.loads(json.dumps(base))
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = PLACEHOLDER
    return json.dumps(body).replace(json.dumps(PLACEHOLDER), fragment(frag)).encode()


def corpus() -> list[tuple[str, str, bytes]]:
    cases = []
    for route, ep in SPEC["endpoints"].items():
        for field in ep["fields"]:
            for frag in SPEC["fragments"]:
                cases.append((route, f"{field}={frag}", with_fragment(ep["base"], (field,), frag)))
    chat = SPEC["endpoints"]["/v1/chat/completions"]["base"]
    for field in SPEC["message_fields"]:
        for frag in SPEC["fragments"]:
            cases.append(("/v1/chat/completions", f"messages[0].{field}={frag}",
                          with_fragment(chat, ("messages", 0, field), frag)))
    for route in SPEC["endpoints"]:
        cases += [(route, f"raw {raw[:20]!r}", raw.encode()) for raw in SPEC["raw_bodies"]]
        cases += [(route, f"bytes {h[:12]}", bytes.fromhex(h)) for h in SPEC["raw_bytes_hex"]]
    return cases


CASES = corpus()


@pytest.fixture(scope="module")
def server():
    from chatfleet.engine.engine import Engine

    torch.set_num_threads(1)
    config = EngineConfig(model="tiny", num_threads=1, max_model_len=512, cache=CacheConfig(num_tokens=2048))
    engine = AsyncEngine(Engine(config), check_integrity_when_idle=True)
    with ServerThread(build_app(engine, options=ServerOptions(request_timeout_s=30))) as srv:
        srv.engine = engine
        yield srv


def assert_healthy_and_empty(server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                    json={"messages": [{"role": "user", "content": "still fine?"}], "max_tokens": 2})
    assert ok.status_code == 200
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = server.engine.call_threadsafe(lambda e: e.stats()).result(timeout=30)
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the engine did not drain: {stats}")


def test_the_malformed_input_corpus_gets_no_5xx(server):
    assert len(CASES) > 300, len(CASES)
    failures, refused = [], 0
    with httpx.Client(timeout=60) as client:
        for route, name, body in CASES:
            r = client.post(server.url + route, content=body, headers={"content-type": "application/json"})
            if r.status_code >= 500:
                failures.append((route, name, r.status_code, r.text[:200]))
            elif r.status_code >= 400:
                refused += 1
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], (route, name)
                assert "Traceback" not in err["message"] and "Exception" not in err["message"], (route, name)
    assert not failures, failures[:10]
    assert refused > len(CASES) // 2  # most of the corpus is wrong and refused
    assert_healthy_and_empty(server)


def test_schemathesis_against_the_engines_openapi_finds_no_5xx(server):
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.generation.modes import GenerationMode

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/tokenize"}
    assert all("400" in op.definition.raw.get("responses", {}) for op in ops if op.method.upper() == "POST")
    errors: list[str] = []
    session = __import__("requests").Session()
    for op in ops:
        if op.path.startswith(("/docs", "/redoc")):
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=10, derandomize=True, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                if isinstance(case.body, dict):
                    case.body.setdefault("max_tokens", 2)  # keep valid requests short
                r = case.call(base_url=server.url, session=session, timeout=60)
                if r.status_code >= 500:
                    errors.append(f"{case.operation.method} {case.operation.path}: {r.status_code} {r.text[:200]}")

            try:
                run()
            except Unsatisfiable:  # nothing to break in an operation without parameters
                assert mode == GenerationMode.NEGATIVE and op.path not in BODY_ROUTES
    assert not errors, errors[:10]
    assert_healthy_and_empty(server)
