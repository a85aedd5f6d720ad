"""Above the caps: new conversations are shed before the returning turns of conversations in
progress, the order holds end to end, and status and metrics count both kinds; a total
timeout ends a reply with an explicit error without blaming the replica."""

from __future__ import annotations

import json
import threading

import httpx
from gateway_helpers import chat_body, wait_for
from prometheus_client.parser import text_string_to_metric_families


def post(gw, session: str, results: dict, name: str, stream: bool = False) -> threading.Thread:
    def run():
        with gw.client(timeout=30.0) as client:
            r = client.post("/v1/chat/completions", json=chat_body(name, stream=stream, max_tokens=1),
                            headers={"X-Session-ID": session})
            results[name] = r.status_code

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_newcomers_are_shed_before_conversations_in_progress(fakes, gateways):
    (fake,) = fakes(1)
    gw = gateways([fake.url], max_in_flight=1, queue_size=4, max_queued_new=2, max_queue_wait_s=30)
    admission = gw.gateway.admission
    with gw.client() as client:  # three conversations have had a turn: they are in progress
        for who in ("A", "B", "C"):
            assert client.post("/v1/chat/completions", json=chat_body(f"{who}1"),
                               headers={"X-Session-ID": who}).status_code == 200
    fake.behavior.step = True
    results: dict[str, int] = {}
    threads = [post(gw, "N0", results, "N0", stream=True)]  # holds the only slot until stepped
    wait_for(lambda: admission.in_flight(fake.url) == 1 and fake.replica.stats.active == 1, what="N0 to hold the slot")
    for name, queued in (("N1", 1), ("N2", 2), ("A2", 3), ("B2", 4)):
        threads.append(post(gw, name[0] if name[0] in "AB" else name, results, name))
        wait_for(lambda q=queued: admission.queued_total == q, what=f"{name} to queue")
    threads.append(post(gw, "N3", results, "N3"))  # two new ones wait already: shed at once
    wait_for(lambda: "N3" in results, what="N3 to be shed")
    threads.append(post(gw, "C", results, "C2"))  # the queue is full: C2 displaces N2
    wait_for(lambda: "N2" in results, what="N2 to be displaced")
    assert results == {"N3": 429, "N2": 429}

    status = gw.client().get("/gateway/status").json()
    assert (status["shed_new"], status["shed_returning"]) == (2, 0)
    fake.replica.step()  # N0 ends; the queue drains, conversations in progress first
    for thread in threads:
        thread.join(30)
    assert results == {"N0": 200, "N1": 200, "N2": 429, "N3": 429, "A2": 200, "B2": 200, "C2": 200}
    served = [r["body"]["messages"][0]["content"] for r in fake.replica.stats.requests]
    assert served == ["A1", "B1", "C1", "N0", "A2", "B2", "C2", "N1"]

    metrics = gw.client().get("/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
               if s.labels.get("replica") == fake.url}
    assert samples["chatfleet:gateway_shed_new_total"] == 2
    assert samples["chatfleet:gateway_shed_returning_total"] == 0


def test_returning_turns_are_shed_too_once_their_own_room_is_full(fakes, gateways):
    (fake,) = fakes(1, step=True)
    gw = gateways([fake.url], max_in_flight=1, queue_size=1, max_queued_new=0, max_queue_wait_s=30)
    gw.gateway.sessions_seen.admitted("A")
    gw.gateway.sessions_seen.admitted("B")
    results: dict[str, int] = {}
    threads = [post(gw, "N0", results, "N0", stream=True)]
    wait_for(lambda: fake.replica.stats.active == 1, what="N0 to hold the slot")
    threads.append(post(gw, "A", results, "A2"))
    wait_for(lambda: gw.gateway.admission.queued_total == 1, what="A2 to queue")
    threads.append(post(gw, "N1", results, "N1"))
    threads.append(post(gw, "B", results, "B2"))
    wait_for(lambda: len(results) == 2, what="N1 and B2 to be shed")
    fake.replica.step()
    for thread in threads:
        thread.join(30)
    assert results == {"N0": 200, "A2": 200, "N1": 429, "B2": 429}
    status = gw.client().get("/gateway/status").json()
    assert (status["shed_new"], status["shed_returning"]) == (1, 1)


def test_total_timeout_ends_a_slow_stream_with_an_error_and_keeps_the_replica(fakes, gateways):
    (fake,) = fakes(1, interval_s=0.05)
    gw = gateways([fake.url], total_timeout_s=0.5, failure_threshold=1)
    with gw.client() as client, client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stream=True, max_tokens=1000)) as response:
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and "total timeout" in json.loads(data[-2])["error"]["message"]
    state = gw.gateway.replicas[fake.url]
    assert state.healthy and state.stats.upstream_errors == 0 and state.stats.stream_breaks == 0
    with httpx.Client(base_url=gw.url) as client:
        assert client.get("/health").status_code == 200
