"""Timing accuracy against a scripted server with known delays (in its own process).

Each chunk carries the server's send time on the shared monotonic clock, so the client's
error is measured per token, not guessed."""

import asyncio

import numpy as np
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
def test_ttft_and_itl_within_2ms_of_server_send_times(scripted, transport):
    url = scripted("--ttft-ms", "40", "--itl-ms", "15")
    streams: dict[int, list[tuple[int, int]]] = {}

    def probe(recv_ns, obj):
        if "x_sent_ns" in obj:
            streams.setdefault(obj["x_req"], []).append((recv_ns, obj["x_sent_ns"]))

    cfg = ClientConfig("scripted", on_chunk=probe)
    res = run(url, LoadSpec("closed", 4, duration_s=2.0, warmup_s=0.0, drain_timeout_s=10), cfg, transport)
    ok = [r for r in res.records if r.status == "ok"]
    assert len(ok) >= 8 and all(r.output_tokens == r.expected_tokens for r in ok)
    # TTFT error: the first token's arrival as the client timed it vs the server's send time.
    ttft_err = np.array([(s[0][0] - s[0][1]) / 1e6 for s in streams.values()])
    # ITL error: each gap as the client timed it vs the gap the server made.
    itl_err = np.array([((r1 - r0) - (s1 - s0)) / 1e6 for s in streams.values()
                        for (r0, s0), (r1, s1) in zip(s, s[1:])])
    assert len(itl_err) >= 50 and (ttft_err >= 0).all()
    # Within 2 ms. The tail is held to p75 here: on two shared cores a busy machine deschedules the
    # client for a scheduler tick (~4 ms) now and then, which is the machine, not the method;
    # benchmarks/loadgen_capacity.py reports the p99 under load.
    for name, err in (("TTFT", ttft_err), ("ITL", np.abs(itl_err))):
        assert np.median(err) < 1.0 and np.percentile(err, 75) < 2.0, \
            f"{name} error median {np.median(err):.2f} ms, p75 {np.percentile(err, 75):.2f} ms"
    # The scripted delays show through: TTFT ~40 ms after the send (plus server work), gaps ~15 ms.
    ttft_after_send = np.array([(r.ttft_s - r.queue_s) * 1e3 for r in ok])
    assert 39.0 <= np.median(ttft_after_send) <= 50.0, ttft_after_send
    gaps = np.array([g * 1e3 for r in ok for g in r.itl_s])
    assert np.median(gaps) == pytest.approx(15.0, abs=2.0)
    assert all(len(r.itl_s) == r.output_tokens - 1 for r in ok)


def test_multi_token_chunks_split_their_gap(scripted):
    url = scripted("--ttft-ms", "20", "--itl-ms", "10", "--tokens-per-chunk", "3")
    cfg = ClientConfig("scripted", continuous_usage=True)
    res = run(url, LoadSpec("concurrency", 2, duration_s=1.0, warmup_s=0.0, drain_timeout_s=10), cfg)
    ok = [r for r in res.records if r.status == "ok"]
    assert ok
    gaps = np.array([g * 1e3 for r in ok for g in r.itl_s])
    # 3 tokens every 30 ms: each token's share is ~10 ms, not 30 ms and not 0.
    assert np.median(gaps) == pytest.approx(10.0, abs=2.0)
    assert all(r.output_tokens == r.expected_tokens for r in ok)


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
    res = run(url, LoadSpec("concurrency", 6, duration_s=1.0, warmup_s=0.0, drain_timeout_s=10), ClientConfig("scripted"))
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
