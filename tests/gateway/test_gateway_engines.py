"""The gateway in front of real built-in engine replicas (tiny model, one torch thread each)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import socket
import time

import httpx
import openai
import pytest
from gateway_helpers import wait_for

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.launcher import Fleet, FleetConfig

CARD = ("You are Captain Mira Vance of the starship Meridian. You speak in short, vivid sentences, "
        "you love old star charts, and you never reveal the ship's secret cargo. ") * 3
FORCE = {"ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def fleet():
    fleet = Fleet(FleetConfig(replicas=2, model="tiny", threads_per_replica=1, engine_args=(
        "--kv-cache-tokens", "8192", "--max-model-len", "2048", "--max-batched-tokens", "256")),
        prepare_model=resolve_model)
    with fleet:
        yield fleet


@pytest.fixture
def engines(fleet):
    return list(fleet.urls)


def http(url: str, timeout: float = 60.0) -> httpx.Client:
    transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    return httpx.Client(base_url=url, timeout=timeout, transport=transport)


def running(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("engine exports no vllm:num_requests_running")


def read_stream(client: httpx.Client, body: dict, headers: dict | None = None) -> dict:
    """A streamed request's outcome: status, events, whether it ended cleanly or with an error."""
    t0 = time.monotonic()
    body = dict(body, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "error": r.json()["error"], "end": time.monotonic() - t0,
                    "headers": r.headers}
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(d) for d in data if d != "[DONE]"]
    errors = [c["error"] for c in chunks if "error" in c]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    return {"status": 200, "done": bool(data) and data[-1] == "[DONE]", "errors": errors,
            "tokens": usage[-1]["completion_tokens"] if usage else None,
            "replica": r.headers["x-chatfleet-replica"], "end": time.monotonic() - t0}


def test_openai_client_through_the_gateway(engines, gateways):
    gw = gateways(engines)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "Hello!"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, extra_body=FORCE)
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5,
                                                 stream=True, extra_body=FORCE))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, extra_body=FORCE)
    assert text.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=3)


def test_turns_stay_on_one_replica_and_hit_its_cache(engines, gateways):
    gw = gateways(engines)
    placement: dict[int, set[str]] = {}
    with http(gw.url) as client:
        history = {s: [{"role": "system", "content": CARD},
                       {"role": "user", "content": f"I am traveller number {s}. Where are we headed?"}]
                   for s in range(6)}
        prompt_tokens: dict[int, int] = {}
        for turn in range(3):
            for s, messages in history.items():
                r = client.post("/v1/chat/completions", json={
                    "model": "tiny", "messages": messages, "max_tokens": 6, **FORCE})
                assert r.status_code == 200, r.text
                placement.setdefault(s, set()).add(r.headers["x-chatfleet-replica"])
                usage = r.json()["usage"]
                if turn:  # everything the replica saw last turn is cached there, full blocks at least
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    assert cached >= prompt_tokens[s] - 16, (turn, s, cached, prompt_tokens[s])
                prompt_tokens[s] = usage["prompt_tokens"]
                messages += [r.json()["choices"][0]["message"],
                             {"role": "user", "content": f"Tell me more, turn {turn}."}]
        # the same return turn on the other replica finds the shared card at most
        s = 0
        other = next(url for url in engines if url not in placement[s])
        cold = httpx.post(other + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": history[s], "max_tokens": 1, **FORCE}).json()["usage"]
        warm = client.post("/v1/chat/completions", json={
            "model": "tiny", "messages": history[s], "max_tokens": 1, **FORCE}).json()["usage"]
        assert warm["prompt_tokens_details"]["cached_tokens"] > cold["prompt_tokens_details"]["cached_tokens"]
    assert all(len(replicas) == 1 for replicas in placement.values())
    status = gw.gateway.status()["replicas"]
    assert sum(r["stats"]["affinity_kept"] for r in status) == 18 + 1
    assert sum(r["stats"]["affinity_broken"] for r in status) == 0


def test_two_gateways_agree_on_placement(engines, gateways):
    one, two = gateways(engines), gateways(list(reversed(engines)))
    with http(one.url) as c1, http(two.url) as c2:
        for s in range(8):
            body = {"model": "tiny", "max_tokens": 1, "messages": [
                {"role": "system", "content": CARD}, {"role": "user", "content": f"hi from {s}"}]}
            a = c1.post("/v1/chat/completions", json=body).headers["x-chatfleet-replica"]
            b = c2.post("/v1/chat/completions", json=body).headers["x-chatfleet-replica"]
            assert a == b


def test_twice_the_cap_sheds_the_excess_at_once(engines, gateways):
    gw = gateways(engines, max_in_flight=2, queue_size=0, retry_after_s=2)
    # long enough replies that the admitted four still run when the last of the eight arrives
    body = {"model": "tiny", "max_tokens": 160, "messages": [{"role": "user", "content": "go"}], **FORCE}
    with http(gw.url) as client, cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(read_stream, client, body, {"X-Session-ID": f"chat-{i}"}) for i in range(8)]
        results = [f.result(timeout=120) for f in futures]
    admitted = [r for r in results if r["status"] == 200]
    shed = [r for r in results if r["status"] == 429]
    assert len(admitted) == 4 and len(shed) == 4, [r["status"] for r in results]
    assert all(r["done"] and not r["errors"] and r["tokens"] == 160 for r in admitted)
    assert {r["replica"] for r in admitted} == set(engines)  # both replicas filled to their cap
    assert all(r["headers"]["retry-after"] == "2" and r["error"]["type"] == "rate_limit_error" for r in shed)
    assert max(r["end"] for r in shed) < min(r["end"] for r in admitted)  # refused while they ran


def test_disconnect_stops_the_engine_request(engines, gateways):
    gw = gateways(engines)
    body = {"model": "tiny", "max_tokens": 1500, "stream": True, **FORCE,
            "messages": [{"role": "user", "content": "tell me a long story"}]}
    with http(gw.url) as client, client.stream("POST", "/v1/chat/completions", json=body) as r:
        replica = r.headers["x-chatfleet-replica"]
        lines = r.iter_lines()  # (kept referenced: a dropped iterator closes the response)
        next(line for line in lines if line.startswith("data: "))
        wait_for(lambda: running(replica) == 1, what="the engine to run the request")
        next(line for line in lines if line.startswith("data: "))
        assert gw.gateway.admission.in_flight(replica) == 1
    wait_for(lambda: running(replica) == 0, timeout=20, what="the engine to drop the request")
    wait_for(lambda: gw.gateway.admission.in_flight(replica) == 0, what="slot release")


def test_hostile_input_never_takes_a_replica_out(engines, gateways):
    # One failure counted against a replica takes it out; slow health checks on a loaded machine don't.
    gw = gateways(engines, failure_threshold=1, health_interval_s=60, health_timeout_s=30)
    surrogate = b'{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800 hi"}]}'
    at_the_gateway = [  # refused before any replica sees them
        b'{"model": "tiny", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}",
        b'{"model": "tiny", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
        b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff"}]}',
    ]
    with http(gw.url) as client:
        for _ in range(3):
            for body in at_the_gateway:
                assert client.post("/v1/chat/completions", content=body).status_code == 400
            for headers in ({}, {"X-Session-ID": "s-surrogate"}):  # without the header: hashed, not a crash
                r = client.post("/v1/chat/completions", content=surrogate, headers=headers)
                assert r.status_code != 502, r.text  # the engine's own answer, passed on as it is
        assert client.get("/health").json()["healthy_replicas"] == len(engines)
        assert client.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}).status_code == 200
    for url in engines:
        state = gw.gateway.replicas[url]
        assert state.healthy and state.stats.marked_down == 0 and state.stats.upstream_errors == 0


def test_killed_replica_loses_no_request(fleet, engines, gateways):
    """Runs last: it kills one engine of the module's fleet."""
    gw = gateways(engines, max_in_flight=3, queue_size=32, max_queue_wait_s=120, health_interval_s=60)
    # streams long enough that the kill lands mid-stream however fast the engine decodes (at 40
    # tokens a faster step could end every victim stream between two polls of its /metrics)
    tokens = 200
    body = {"model": "tiny", "max_tokens": tokens, "messages": [{"role": "user", "content": "count"}], **FORCE}
    victim = engines[0]
    with http(gw.url) as client, cf.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(read_stream, client, body, {"X-Session-ID": f"kill-{i}"}) for i in range(12)]
        wait_for(lambda: gw.gateway.admission.in_flight(victim) >= 1 and running(victim) >= 1,
                 timeout=60.0, what="streams on the victim")
        fleet.processes[fleet.urls.index(victim)].send_signal(signal.SIGKILL)  # mid-stream
        results = [f.result(timeout=120) for f in futures]
        # after the kill: sessions homed on the victim are retried on (or routed to) the survivor
        later = [read_stream(client, dict(body, max_tokens=3), {"X-Session-ID": f"after-{i}"}) for i in range(8)]
    for r in results:  # every request: a full reply, or an explicit error; never a silent cut
        assert r["status"] != 200 or r["done"], r
        if r["status"] == 200 and not r["errors"]:
            assert r["tokens"] == tokens
        elif r["status"] == 200:
            assert "mid-stream" in r["errors"][0]["message"]
    assert sum(1 for r in results if r["status"] == 200 and not r["errors"]) >= 12 - 3
    assert all(r["status"] == 200 and r["done"] and not r["errors"] for r in later)
    assert {r["replica"] for r in later} == {engines[1]}
    state = gw.gateway.replicas[victim]
    assert not state.healthy and state.stats.marked_down == 1


def test_engines_share_the_callers_session_in_process_groups_of_their_own(fleet):
    """Priorities hold across the fleet: an engine in a session of its own is a scheduling group
    of its own (Linux autogroup), so its niced tokenizing worker would share a core equally with
    the gateway; in the caller's session it yields. Each engine still leads its own process group
    (a terminal's Ctrl-C reaches the caller, which stops the engines itself)."""
    for proc in fleet.processes:
        assert os.getsid(proc.pid) == os.getsid(0)
        assert os.getpgid(proc.pid) == proc.pid
