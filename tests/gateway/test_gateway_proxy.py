"""The gateway in front of fake replicas: pass-through, affinity, admission, failover, protection."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from gateway_helpers import chat_body, dead_url, wait_for
from prometheus_client.parser import text_string_to_metric_families


def events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def metric(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise KeyError(name)


def test_stream_passes_through_chunk_by_chunk(fakes, gateways):
    (fake,) = fakes(1, step=True)
    gw = gateways([fake.url])
    fake.replica.step()  # headers go out with the first chunk (failures before it are retried)
    with gw.client(timeout=5.0) as client, client.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=4)
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-chatfleet-replica"] == fake.url
        lines = (line for line in response.iter_lines() if line)
        for i in range(4):  # the next chunk leaves the replica only once the client saw this one
            if i:
                fake.replica.step()
            assert json.loads(next(lines)[6:])["choices"][0]["delta"]["content"] == "tok "
        assert next(lines) == "data: [DONE]"
    wait_for(lambda: fake.replica.stats.completed == 1, what="the replica to finish")


def test_completions_models_and_request_id(fakes, gateways):
    (fake,) = fakes(1)
    gw = gateways([fake.url])
    with gw.client() as client:
        r = client.post("/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3},
                        headers={"X-Request-ID": "req-42", "X-Session-ID": "s1"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "tok tok tok "
        assert r.headers["x-request-id"] == "req-42" and r.headers["x-chatfleet-replica"] == fake.url
        seen = fake.replica.stats.requests[-1]["headers"]
        assert seen["x-request-id"] == "req-42" and seen["x-session-id"] == "s1"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["fake"]
        assert client.get("/health").json()["healthy_replicas"] == 1


def test_official_openai_client_streams_and_not(fakes, gateways):
    gw = gateways([f.url for f in fakes(2)])
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    reply = client.chat.completions.create(model="fake", messages=msgs, max_tokens=2)
    assert reply.choices[0].message.content == "tok tok "
    stream = client.chat.completions.create(model="fake", messages=msgs, max_tokens=3, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "tok tok tok "


def test_every_turn_of_a_session_hits_one_replica(fakes, gateways):
    gw = gateways([f.url for f in fakes(3)])
    placement = {}
    with gw.client() as client:
        for turn in range(3):
            for s in range(20):
                messages = [{"role": "system", "content": "shared card"}, {"role": "user", "content": f"I am {s}"}]
                messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}] * turn
                r = client.post("/v1/chat/completions", json={"model": "fake", "messages": messages})
                assert r.status_code == 200
                placement.setdefault(s, set()).add(r.headers["x-chatfleet-replica"])
    assert all(len(replicas) == 1 for replicas in placement.values())
    assert len(set().union(*placement.values())) > 1  # sessions sharing a card still spread
    text = gw.client().get("/metrics").text
    kept = sum(metric(text, "chatfleet:gateway_affinity_kept_total", replica=f) for f in gw.gateway.replicas.urls)
    assert kept == 60


def test_two_gateways_place_sessions_alike(fakes, gateways):
    urls = [f.url for f in fakes(3)]
    one, two = gateways(urls), gateways(list(reversed(urls)))
    with one.client() as c1, two.client() as c2:
        for s in range(30):
            body, headers = chat_body(), {"X-Session-ID": f"user-{s}"}
            a = c1.post("/v1/chat/completions", json=body, headers=headers).headers["x-chatfleet-replica"]
            b = c2.post("/v1/chat/completions", json=body, headers=headers).headers["x-chatfleet-replica"]
            assert a == b


def test_over_the_cap_is_shed_at_once_with_retry_after(fakes, gateways):
    (fake,) = fakes(1, step=True)
    gw = gateways([fake.url], max_in_flight=1, queue_size=0, retry_after_s=3)
    fake.replica.step()  # the first chunk; the stream then holds its slot until the next step
    with gw.client() as client, client.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=2)
    ) as held:
        wait_for(lambda: fake.replica.stats.active == 1, what="stream to start")
        # Answered while the held stream still holds the only slot: shed without waiting.
        shed = client.post("/v1/chat/completions", json=chat_body())
        assert fake.replica.stats.active == 1
        assert shed.status_code == 429 and shed.headers["retry-after"] == "3"
        assert shed.json()["error"]["type"] == "rate_limit_error"
        assert "cap of 1" in shed.json()["error"]["message"]
        fake.replica.step()
        assert events(held)[-1] == "[DONE]"
    with gw.client() as client:
        fake.behavior.step = False
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200
        assert metric(client.get("/metrics").text, "chatfleet:gateway_shed_total", replica=fake.url) == 1


def test_queued_request_runs_when_a_slot_frees_or_times_out(fakes, gateways):
    (fake,) = fakes(1, step=True)
    gw = gateways([fake.url], max_in_flight=1, queue_size=4, max_queue_wait_s=0.5)
    fake.replica.step()  # the first chunk; the stream then holds its slot until the next step
    with gw.client() as client, client.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=2)
    ) as held:
        wait_for(lambda: fake.replica.stats.active == 1, what="stream to start")
        timed_out = client.post("/v1/chat/completions", json=chat_body())
        assert timed_out.status_code == 429 and "within 0.5 s" in timed_out.json()["error"]["message"]
        fake.replica.step()
        events(held)
    fake.behavior.step = False
    text = gw.client().get("/metrics").text
    assert metric(text, "chatfleet:gateway_queue_wait_seconds_count", replica=fake.url) >= 2
    assert metric(text, "chatfleet:gateway_queue_wait_seconds_sum", replica=fake.url) >= 0.4


def test_dead_replica_requests_are_retried_elsewhere(fakes, gateways):
    (fake,) = fakes(1)
    dead = dead_url()
    gw = gateways([dead, fake.url], health_interval_s=60)  # passive detection only
    state = gw.gateway.replicas[dead]
    assert not state.healthy  # its first health check failed
    state.healthy, state.consecutive_failures = True, 0  # as if it died after the last check
    with gw.client() as client:
        for s in range(20):
            r = client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-ID": f"s{s}"})
            assert r.status_code == 200 and r.headers["x-chatfleet-replica"] == fake.url
        status = client.get("/gateway/status").json()["replicas"]
    dead_state = next(r for r in status if r["url"] == dead)
    assert not dead_state["healthy"] and dead_state["stats"]["retried"] >= 1
    assert dead_state["stats"]["marked_down"] == 2  # at start, then by passive error counting


def test_replica_failure_is_retried_then_replica_rejoins(fakes, gateways):
    sick, well = fakes(2)
    sick.behavior.status = 502  # a replica failure (see gateway/faults.py)
    gw = gateways([sick.url, well.url], failure_threshold=2)
    with gw.client() as client:
        for s in range(10):
            r = client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-ID": f"s{s}"})
            assert r.status_code == 200 and r.headers["x-chatfleet-replica"] == well.url
        sick.behavior.healthy = False
        wait_for(lambda: not gw.gateway.replicas[sick.url].healthy, what="sick replica marked down")
        sick.behavior.status, sick.behavior.healthy = 200, True
        wait_for(lambda: gw.gateway.replicas[sick.url].healthy, what="replica to rejoin")
        served = {client.post("/v1/chat/completions", json=chat_body(),
                              headers={"X-Session-ID": f"s{s}"}).headers["x-chatfleet-replica"]
                  for s in range(20)}
        assert served == {sick.url, well.url}


def test_a_500_about_the_request_is_passed_on_and_never_marks_the_replica_down(fakes, gateways):
    sick, well = fakes(2)
    sick.behavior.status = 500  # no replica-fault code: the replica's answer to this request
    gw = gateways([sick.url, well.url], failure_threshold=1)
    with gw.client() as client:
        home = [s for s in range(40) if gw.gateway.router.route(f"s{s}", [sick.url, well.url], {}, []).replica
                == sick.url]
        assert home
        for s in home[:5]:
            r = client.post("/v1/chat/completions", json=chat_body(), headers={"X-Session-ID": f"s{s}"})
            assert r.status_code == 500 and r.headers["x-chatfleet-replica"] == sick.url
        assert len(well.replica.stats.requests) == 0  # never retried elsewhere
        state = gw.gateway.replicas[sick.url]
        assert state.healthy and state.stats.upstream_errors == 0 and state.stats.marked_down == 0


def test_all_replicas_failing_gives_an_explicit_error(fakes, gateways):
    a, b = fakes(2, status=502)
    gw = gateways([a.url, b.url], failure_threshold=100)
    with gw.client() as client:
        r = client.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 502 and "fake error" in r.json()["error"]["message"]
    gw2 = gateways([dead_url()])
    with gw2.client() as client:
        r = client.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
        assert client.get("/health").status_code == 503


def test_stream_broken_midway_ends_with_an_error_event(fakes, gateways):
    (fake,) = fakes(1, break_after=2)
    gw = gateways([fake.url])
    with gw.client(timeout=10.0) as client, client.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=6)
    ) as response:
        data = events(response)
    assert len(data) == 4 and data[-1] == "[DONE]"
    assert "failed mid-stream" in json.loads(data[2])["error"]["message"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="mid-stream"):
        for _ in client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=6, stream=True):
            pass
    assert gw.gateway.replicas[fake.url].stats.stream_breaks == 2


def test_client_disconnect_closes_the_upstream_stream(fakes, gateways):
    (fake,) = fakes(1, step=True)
    gw = gateways([fake.url], max_in_flight=4)
    fake.replica.step()
    with gw.client() as client, client.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=50)
    ) as response:
        lines = response.iter_lines()  # (kept referenced: a dropped iterator closes the response)
        next(line for line in lines if line)
        assert gw.gateway.admission.in_flight(fake.url) == 1
    wait_for(lambda: fake.replica.stats.disconnected == 1, what="replica to see the disconnect")
    wait_for(lambda: fake.replica.stats.active == 0, what="the replica's stream to end")
    wait_for(lambda: gw.gateway.admission.in_flight(fake.url) == 0, what="slot release")


def test_client_leaving_the_queue_frees_its_place(fakes, gateways):
    (fake,) = fakes(1, step=True)
    gw = gateways([fake.url], max_in_flight=1, queue_size=4)
    fake.replica.step()  # the first chunk; the stream then holds its slot until the next step
    with gw.client() as client, client.stream(
        "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=2)
    ):
        wait_for(lambda: fake.replica.stats.active == 1, what="stream to start")
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=chat_body(), timeout=0.3)
        wait_for(lambda: gw.gateway.admission.queued_total == 0, what="queue place freed")
        fake.replica.step()


def test_api_keys_body_limit_and_bad_input(fakes, gateways):
    (fake,) = fakes(1)
    gw = gateways([fake.url], api_keys=("k1", "k2"), max_body_bytes=2000)
    auth = {"Authorization": "Bearer k2"}
    with gw.client() as client:
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 401
        r = client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models").status_code == 401
        assert client.get("/health").status_code == 200
        assert client.post("/v1/chat/completions", json=chat_body(), headers=auth).status_code == 200
        assert "authorization" not in fake.replica.stats.requests[-1]["headers"]  # the gateway's key stays here
        before = len(fake.replica.stats.requests)
        big = client.post("/v1/chat/completions", json=chat_body("x" * 3000), headers=auth)
        assert big.status_code == 413
        for bad in (b"{not json", b"[1]", json.dumps({"model": "fake"}).encode(),
                    json.dumps(chat_body(temperature=9)).encode(),
                    json.dumps(chat_body(model="other")).encode()):
            r = client.post("/v1/chat/completions", content=bad, headers=auth)
            assert r.status_code in (400, 404) and r.json()["error"]["message"], bad
        assert client.post("/v1/completions", json={"model": "fake"}, headers=auth).status_code == 400
        assert len(fake.replica.stats.requests) == before  # no bad request reached the replica
        assert client.post("/v1/chat/completions", json=chat_body(), headers=auth).status_code == 200


def test_metrics_export_ttft_and_per_replica_counters(fakes, gateways):
    (fake,) = fakes(1)
    gw = gateways([fake.url])
    with gw.client() as client:
        for _ in range(3):
            client.post("/v1/chat/completions", json=chat_body(stream=True))
        text = client.get("/metrics").text
    assert metric(text, "chatfleet:gateway_time_to_first_token_seconds_count", replica=fake.url) == 3
    assert metric(text, "chatfleet:gateway_requests_total", replica=fake.url) == 3
    assert metric(text, "chatfleet:gateway_in_flight", replica=fake.url) == 0
    assert metric(text, "chatfleet:gateway_replica_healthy", replica=fake.url) == 1


def test_a_gateway_bug_still_gets_an_explicit_error(fakes, gateways):
    (fake,) = fakes(1)
    gw = gateways([fake.url])

    class Broken:
        def route(self, *args):
            raise RuntimeError("routing exploded")

    gw.gateway.router = Broken()
    with gw.client() as client:
        r = client.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-ID": "req-7"})
        message = r.json()["error"]["message"]
        assert r.status_code == 500 and "req-7" in message
        assert "exploded" not in message and "RuntimeError" not in message  # those go to the log
        assert gw.gateway.admission.in_flight(fake.url) == 0


def test_client_leaving_before_the_first_token_reaches_the_replica(fakes, gateways):
    (fake,) = fakes(1, step=True)  # the replica holds its first chunk (a long prefill)
    gw = gateways([fake.url])
    with gw.client() as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=chat_body(stream=True), timeout=0.5)
    wait_for(lambda: fake.replica.stats.disconnected == 1, what="replica to see the client leave")
    wait_for(lambda: gw.gateway.admission.in_flight(fake.url) == 0, what="slot release")


def test_paced_pieces_cover_the_body_and_spend_the_budget():
    from chatfleet.gateway.proxy import paced_pieces
    from chatfleet.protocol.read_pacing import ReadPacer

    class Recording(ReadPacer):
        def __init__(self):
            super().__init__(1 << 40)
            self.taken: list[int] = []

        async def take(self, n: int) -> None:
            self.taken.append(n)

    async def collect(body: bytes, pacer: Recording) -> list[bytes]:
        return [piece async for piece in paced_pieces(body, pacer, piece=1000)]

    body = bytes(range(256)) * 10  # 2560 bytes
    pacer = Recording()
    pieces = asyncio.run(collect(body, pacer))
    assert b"".join(pieces) == body and [len(p) for p in pieces] == [1000, 1000, 560]
    assert pacer.taken == [1000, 1000, 560]  # each piece waits for its share before it goes


def test_a_large_body_reaches_the_replica_whole_with_its_length_even_on_a_retry(fakes, gateways):
    """Large bodies go upstream in paced pieces with a declared length (not chunked): the replica
    reads the very body the client sent, and a retry on another replica sends it whole again."""
    (fake,) = fakes(1)
    dead = dead_url()
    gw = gateways([dead, fake.url], health_interval_s=60, body_offload_bytes=256 << 10)
    state = gw.gateway.replicas[dead]
    state.healthy, state.consecutive_failures = True, 0  # as if it died after the last check
    sent = []
    with gw.client(timeout=30.0) as client:
        for s in range(16):  # some sessions land on the dead replica first (all 16 miss it: 2^-16)
            body = chat_body("word " * 60_000 + str(s), max_tokens=2)
            raw = json.dumps(body).encode()
            sent.append((raw, body))
            r = client.post("/v1/chat/completions", content=raw, headers={
                "X-Session-ID": f"s{s}", "content-type": "application/json"})
            assert r.status_code == 200 and r.headers["x-chatfleet-replica"] == fake.url
    assert gw.gateway.replicas[dead].stats.retried >= 1
    seen = [req for req in fake.replica.stats.requests if req["path"] == "/v1/chat/completions"]
    assert [req["body"] for req in seen] == [body for _, body in sent]
    for req, (raw, _) in zip(seen, sent, strict=True):
        assert req["headers"]["content-length"] == str(len(raw)) and "transfer-encoding" not in req["headers"]
