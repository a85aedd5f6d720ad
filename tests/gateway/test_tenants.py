"""Tenants end to end: one per gateway API key, each with its own prefix-cache salt forwarded as
``cache_salt``, session ids scoped by tenant, and per-key concurrency and token-rate limits."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from gateway_helpers import chat_body, wait_for

from chatfleet.errors import RateLimitError
from chatfleet.gateway.tenants import TenantLimits, tenant_of_key, with_cache_salt

A, B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
KEYS = ("key-a", "key-b")


def test_the_salt_is_added_last_so_it_wins():
    body = with_cache_salt(b'{"model": "m", "cache_salt": "mine"} \n', "t/mine")
    assert json.loads(body)["cache_salt"] == "t/mine"
    assert json.loads(with_cache_salt(b"{}", "s")) == {"cache_salt": "s"}
    a, b = tenant_of_key("key-a"), tenant_of_key("key-b")
    assert a.id != b.id and a.cache_salt != b.cache_salt and "key-a" not in (a.cache_salt or "")
    assert a.scope("s1") != b.scope("s1") and a.salt("x") == f"{a.cache_salt}/x"


def test_salts_and_scoped_sessions_reach_the_replica(fakes, gateways):
    (fake,) = fakes(1)
    gw = gateways([fake.url], api_keys=KEYS)
    with gw.client() as client:
        for auth in (A, B):
            r = client.post("/v1/chat/completions", json=chat_body("same"), headers={**auth, "X-Session-ID": "s1"})
            assert r.status_code == 200, r.text
        r = client.post("/v1/chat/completions", json=chat_body("same", cache_salt="a's?"), headers=B)
        assert r.status_code == 200
    seen = [(q["body"]["cache_salt"], {k.lower(): v for k, v in q["headers"].items()}.get("x-session-id"))
            for q in fake.replica.stats.requests if q["path"] == "/v1/chat/completions"]
    a, b = tenant_of_key("key-a"), tenant_of_key("key-b")
    assert seen == [(a.cache_salt, a.scope("s1")), (b.cache_salt, b.scope("s1")), (f"{b.cache_salt}/a's?", None)]


def test_per_key_in_flight_limit_answers_429_with_retry_after(fakes, gateways):
    (fake,) = fakes(1, step=True)
    gw = gateways([fake.url], api_keys=KEYS, key_max_in_flight=1)
    with gw.client() as client, gw.client() as other:
        done = {}

        def held() -> None:
            done["a"] = client.post("/v1/chat/completions", json=chat_body("long", stream=True), headers=A).status_code

        t = threading.Thread(target=held)
        t.start()
        wait_for(lambda: fake.replica.stats.active == 1, what="A's first request at the replica")
        r = other.post("/v1/chat/completions", json=chat_body("again"), headers=A)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "in flight" in r.json()["error"]["message"]
        fake.behavior.step = False
        fake.replica.step(100)
        t.join(30)
        assert done["a"] == 200
        assert other.post("/v1/chat/completions", json=chat_body("b"), headers=B).status_code == 200
        assert other.post("/v1/chat/completions", json=chat_body("now"), headers=A).status_code == 200  # released


def test_per_key_token_rate_answers_429_with_retry_after():
    now = [0.0]
    limits = TenantLimits(None, 600, clock=lambda: now[0])  # 10 tokens a second
    a, b = tenant_of_key("key-a"), tenant_of_key("key-b")
    limits.admit(a, 500)()
    with pytest.raises(RateLimitError) as err:
        limits.admit(a, 200)
    assert err.value.status_code == 429 and err.value.retry_after_s == 10  # 100 short at 10/s
    limits.admit(b, 600)()  # another key has its own bucket
    now[0] = 10.0
    limits.admit(a, 200)()  # 100 left + 10 s at 10/s
    with pytest.raises(RateLimitError):
        limits.admit(a, 1)
    now[0] = 200.0
    limits.admit(a, 10_000)  # more than a whole bucket: allowed once the bucket is full...
    with pytest.raises(RateLimitError):
        limits.admit(a, 1)  # ...and it is empty after


def test_token_rate_through_the_gateway(fakes, gateways):
    (fake,) = fakes(1)
    gw = gateways([fake.url], api_keys=KEYS, key_tokens_per_minute=120)
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat_body("x", max_tokens=100), headers=A).status_code == 200
        r = client.post("/v1/chat/completions", json=chat_body("x", max_tokens=100), headers=A)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert client.post("/v1/chat/completions", json=chat_body("x", max_tokens=100), headers=B).status_code == 200


# -- a real tiny engine --------------------------------------------------------------------

CARD = ("You are Captain Mira Vance of the starship Meridian. You speak in short, vivid sentences, "
        "you love old star charts, and you never reveal the ship's secret cargo. ") * 4


@pytest.fixture(scope="module")
def engine_url():
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.launcher import Fleet, FleetConfig

    fleet = Fleet(FleetConfig(replicas=1, model="tiny", threads_per_replica=1, engine_args=(
        "--kv-cache-tokens", "4096", "--max-model-len", "1024")), prepare_model=resolve_model)
    with fleet:
        yield fleet.urls[0]


def test_tenant_b_never_gets_a_token_only_tenant_a_cached(engine_url, gateways):
    gw = gateways([engine_url], api_keys=KEYS)

    def cached(auth: dict, system: str, **extra) -> int:
        body = {"model": "tiny", "max_tokens": 1, "temperature": 0.0, **extra,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
        with gw.client(timeout=120) as client:
            r = client.post("/v1/chat/completions", json=body, headers=auth)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    wait_for(lambda: httpx.get(gw.url + "/health").status_code == 200, what="the engine")
    assert cached(A, CARD) == 0
    assert cached(A, CARD) > 0  # A's own prompt is cached for A
    assert cached(B, CARD) == 0  # ...and not for B
    a_salt = tenant_of_key("key-a").cache_salt
    assert cached(B, CARD, cache_salt=a_salt) == 0  # naming A's salt reads nothing of A's...
    other = "A different card, for the salt test only. " * 8
    assert cached(B, other, cache_salt=a_salt) == 0
    assert cached(A, other) == 0  # ...and writes nothing into A's cache
    assert cached(B, CARD) > 0  # B's cache works: what B itself sent
