"""The client against a scripted server with known delays (in its own process).

Each chunk carries the server's send time on the shared monotonic clock. The tests check what
cannot depend on a busy machine: counts, causality, the client's arithmetic on its own arrival
times. How close the timing comes is benchmarks/client_timing.py's figure."""

import asyncio
import itertools

import pytest

from chatfleet.bench.client import ClientConfig
from chatfleet.bench.loops import LoadSpec, run_load
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.transport import make_transport
from chatfleet.bench.workload import Workload, get_profile


def run(url, spec, cfg, transport="raw", seed=1):
    w = Workload(get_profile("cpu-roleplay"), seed, EstimateCounter())

    async def go():
        t = make_transport(transport, url)
        try:
            return await run_load(w, t, cfg, spec, seed)
        finally:
            await t.close()

    return asyncio.run(go())


@pytest.mark.parametrize("transport", ["raw", "httpx"])
def test_ttft_and_itl_are_the_arrival_times_of_the_server_chunks(scripted, transport):
    """The client's figures are its own arrival times, chunk for chunk, and never earlier than the
    server sent or scripted them. How close they come to the send times is a figure, not a pass
    or fail: benchmarks/client_timing.py prints it."""
    url = scripted("--ttft-ms", "40", "--itl-ms", "15")
    streams: dict[int, list[tuple[int, int]]] = {}

    def probe(recv_ns, obj):
        if "x_sent_ns" in obj:
            streams.setdefault(obj["x_req"], []).append((recv_ns, obj["x_sent_ns"]))

    cfg = ClientConfig("scripted", on_chunk=probe)
    res = run(url, LoadSpec("closed", 4, duration_s=2.0, warmup_s=0.0, drain_timeout_s=10), cfg, transport)
    ok = [r for r in res.records if r.status == "ok"]
    assert ok and all(r.output_tokens == r.expected_tokens for r in ok)
    assert all(len(r.itl_s) == r.output_tokens - 1 for r in ok)
    # Causality: nothing arrives before it was sent.
    assert all(recv >= sent for s in streams.values() for recv, sent in s)
    # The client's gaps are exactly the gaps between the chunks' arrivals (one token per chunk).
    arrival_gaps = sorted((r1 - r0) * 1e-9 for s in streams.values() for (r0, _), (r1, _) in itertools.pairwise(s))
    assert sorted(g for r in res.records for g in r.itl_s) == arrival_gaps
    # The scripted delays are floors: the first token comes no sooner than 40 ms after the send,
    # the last no sooner than 40 ms + 15 ms per further token. The server's event-loop timers
    # (libuv's, in whole milliseconds on a cached clock) may fire up to ~1 ms early: 2 ms slack.
    slack = 2e-3
    for r in ok:
        assert r.ttft_s - r.queue_s >= 0.040 - slack, r
        assert r.reply_s - r.queue_s >= 0.040 + 0.015 * (r.output_tokens - 1) - slack, r


def test_multi_token_chunks_split_their_gap(scripted):
    url = scripted("--ttft-ms", "20", "--itl-ms", "10", "--tokens-per-chunk", "3")
    chunks: dict[int, list[tuple[int, int]]] = {}

    def probe(recv_ns, obj):
        if "x_sent_ns" in obj:
            chunks.setdefault(obj["x_req"], []).append((recv_ns, obj["usage"]["completion_tokens"]))

    cfg = ClientConfig("scripted", continuous_usage=True, on_chunk=probe)
    res = run(url, LoadSpec("concurrency", 2, duration_s=1.0, warmup_s=0.0, drain_timeout_s=10), cfg)
    ok = [r for r in res.records if r.status == "ok"]
    assert ok and all(r.output_tokens == r.expected_tokens for r in ok)
    assert any(r.output_tokens > 6 for r in ok)
    # Each chunk after the first brings up to 3 tokens; its gap is shared evenly among them: the
    # client's gaps are, exactly, each chunk's arrival gap over its token count, that many times.
    expected = sorted(g for cs in chunks.values() for (r0, n0), (r1, n1) in itertools.pairwise(cs)
                      for g in [(r1 - r0) * 1e-9 / (n1 - n0)] * (n1 - n0))
    assert sorted(g for r in res.records for g in r.itl_s) == expected
    assert all(len(r.itl_s) == r.output_tokens - min(3, r.output_tokens) for r in ok)


def test_latency_counts_from_intended_send_time(scripted):
    """A client that cannot send on time (one connection for many chats would be worse) still
    charges the delay: TTFT includes the client-side queue."""
    url = scripted("--ttft-ms", "10", "--itl-ms", "5")
    res = run(url, LoadSpec("closed", 3, duration_s=1.0, warmup_s=0.0, drain_timeout_s=10), ClientConfig("scripted"))
    for r in res.records:
        assert r.ttft_s >= r.queue_s
        assert r.sent_s == pytest.approx(r.intended_s + r.queue_s, abs=1e-6)
        assert r.reply_s >= r.ttft_s


def test_429_and_errors_are_records_not_dropped(scripted):
    url = scripted("--ttft-ms", "50", "--itl-ms", "20", "--max-inflight", "2")
    res = run(url, LoadSpec("concurrency", 6, duration_s=1.0, warmup_s=0.0, drain_timeout_s=10),
              ClientConfig("scripted"))
    statuses = [r.status for r in res.records]
    assert "rate_limited" in statuses and "ok" in statuses
    limited = [r for r in res.records if r.status == "rate_limited"]
    assert all(r.http_status == 429 and "too many" in r.error for r in limited)
    # Nothing sent is missing: every record is either finished or failed.
    assert all(r.status != "ok" or r.end_s is not None for r in res.records)


def test_unreachable_server_gives_error_records():
    res = run("http://127.0.0.1:9", LoadSpec("concurrency", 2, duration_s=0.3, warmup_s=0.0, drain_timeout_s=5),
              ClientConfig("x"))
    assert res.records and all(r.status == "error" and "Error" in r.error for r in res.records)


def test_open_loop_is_bounded_and_seeded(scripted):
    url = scripted("--ttft-ms", "5", "--itl-ms", "2")
    spec = LoadSpec("open", 8.0, duration_s=1.0, warmup_s=0.0, drain_timeout_s=10, max_requests=12)
    a = run(url, spec, ClientConfig("scripted"), seed=4)
    assert 1 <= len(a.records) <= 12
    assert all(r.status == "ok" for r in a.records)
