"""API keys on every route but /health and /metrics, admin routes off by default, a cache salt per key."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.auth import key_salt
from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.api.server import build_app
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.errors import ConfigError
from chatfleet.loopback import ServerThread

KEYS = ("key-alice", "key-bob")
PROMPT = " ".join(f"shared system prompt line {i}" for i in range(40))


@pytest.fixture(scope="module")
def server():
    from chatfleet.engine.engine import Engine

    torch.set_num_threads(1)
    config = EngineConfig(model="tiny", num_threads=1, max_model_len=1024, cache=CacheConfig(num_tokens=4096))
    engine = AsyncEngine(Engine(config))
    with ServerThread(build_app(engine, options=ServerOptions(api_keys=KEYS, enable_admin_api=True))) as srv:
        yield srv


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ROUTES = [("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
          ("GET", "/v1/models", None), ("GET", "/v1/models/tiny", None),
          ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/reset_prefix_cache", None),
          ("GET", "/openapi.json", None)]


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_route_needs_a_key(server, method, path, body):
    for headers in ({}, auth("wrong"), {"Authorization": "Basic a2V5LWFsaWNl"}):
        r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, (path, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["type"] == "authentication_error"
    r = httpx.request(method, server.url + path, json=body, headers=auth("key-bob"), timeout=60)
    assert r.status_code == 200, (path, r.text)


def test_health_and_metrics_stay_open(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_the_openai_client_works_with_its_key_and_not_without(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key="key-alice", max_retries=0)
    assert good.models.list().data[0].id == "tiny"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def cached_tokens(server, key: str, **extra) -> int:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1, "temperature": 0, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_tenant_cannot_hit_another_tenants_cached_prompt(server):
    httpx.post(server.url + "/reset_prefix_cache", headers=auth("key-alice"))
    assert cached_tokens(server, "key-alice") == 0
    assert cached_tokens(server, "key-alice") > 0  # the same tenant hits its own prompt
    assert cached_tokens(server, "key-bob") == 0  # another tenant does not
    # nor by naming the other tenant's salt: a requested salt stays under the caller's own
    assert cached_tokens(server, "key-bob", cache_salt=key_salt("key-alice")) == 0


def test_admin_routes_are_404_unless_enabled():
    from chatfleet.engine.engine import Engine

    engine = AsyncEngine(Engine(EngineConfig(model="tiny", num_threads=1, max_model_len=256,
                                             cache=CacheConfig(num_tokens=1024))))
    with ServerThread(build_app(engine)) as srv:
        r = httpx.post(srv.url + "/reset_prefix_cache")
        assert r.status_code == 404 and "--enable-admin-api" in r.json()["error"]["message"]


def test_keys_come_from_the_flag_or_the_environment():
    assert ServerOptions.keys_from("a,b", {"CHATFLEET_API_KEY": "c"}) == ("a", "b")
    assert ServerOptions.keys_from(None, {"CHATFLEET_API_KEY": "c"}) == ("c",)
    assert ServerOptions.keys_from(None, {}) == ()
    with pytest.raises(ConfigError):
        ServerOptions(api_keys=(" padded",))
    assert "key-alice" not in repr(ServerOptions(api_keys=KEYS))
