"""Per-replica caps from a sweep's knee, in requests in flight (Little's law for live chats)."""

from __future__ import annotations

import json

import pytest

from chatfleet.bench.records import RequestRecord
from chatfleet.bench.stats import summarize
from chatfleet.cli.gateway_cmd import build_gateway_config
from chatfleet.errors import ConfigError
from chatfleet.gateway.config import Profile
from chatfleet.gateway.knee import knee_cap, read_knee


def closed_loop_run(chats: int, service_s: float, think_s: float, window_s: float, warmup_s: float = 2.0) -> dict:
    """One run of ``chats`` live chats, each alternating a request of ``service_s`` and a pause
    of ``think_s``, as `chatfleet sweep` writes it: in flight on average chats*S/(S+T)."""
    records = []
    for slot in range(chats):
        t = slot * (service_s + think_s) / chats  # staggered starts
        while t < warmup_s + window_s:
            records.append(RequestRecord(conv_id=slot, turn=0, character_id=0, slot=slot, intended_s=t, sent_s=t,
                                         first_token_s=t + 0.1, end_s=t + service_s, ttft_s=0.1,
                                         reply_s=service_s, output_tokens=8, warmup=t < warmup_s))
            t += service_s + think_s
    # only requests sent inside the window count, as the bench's summary does
    summary = summarize(records, None, window_s).to_dict()
    return {"summary": summary, "records": [r.to_dict() for r in records], "throttled": False}


def sweep_doc(knee: float, runs: list[dict], mode: str = "closed") -> dict:
    return {"format": "chatfleet.bench", "kind": "sweep",
            "series": {"http://r:1": {"mode": mode, "knee": knee, "knee_reached": True,
                                      "points": [{"level": knee / 2, "passed": True, "runs": []},
                                                 {"level": knee, "passed": True, "runs": runs},
                                                 {"level": knee + 1, "passed": False, "runs": []}]}}}


def test_a_closed_loop_knee_becomes_requests_in_flight(tmp_path):
    path = tmp_path / "sweep.json"
    # 12 live chats, 1 s requests, 2 s pauses: 4 requests in flight on average, not 12
    path.write_text(json.dumps(sweep_doc(12, [closed_loop_run(12, 1.0, 2.0, window_s=60.0)])))
    cap = knee_cap(path)
    assert cap.mode == "closed" and cap.knee == 12
    assert cap.in_flight == pytest.approx(4.0, rel=0.05)
    assert cap.cap == int(cap.in_flight) and 3 <= cap.cap <= 4
    assert "12 live chats" in cap.describe()


def test_in_flight_is_averaged_over_the_knee_points_runs(tmp_path):
    path = tmp_path / "sweep.json"
    runs = [closed_loop_run(10, 1.0, 1.0, window_s=40.0), closed_loop_run(10, 3.0, 1.0, window_s=40.0)]
    path.write_text(json.dumps(sweep_doc(10, runs)))
    assert knee_cap(path).in_flight == pytest.approx((5.0 + 7.5) / 2, rel=0.05)
    assert read_knee(path) == 6


def test_without_records_the_rate_and_mean_latency_give_it(tmp_path):
    path = tmp_path / "sweep.json"
    run = closed_loop_run(8, 0.5, 1.5, window_s=40.0)
    run["records"] = []
    path.write_text(json.dumps(sweep_doc(8, [run])))
    assert knee_cap(path).in_flight == pytest.approx(2.0, rel=0.1)


def test_a_concurrency_knee_is_the_cap_and_unusable_knees_are_refused(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep_doc(6, [], mode="concurrency")))
    assert knee_cap(path).cap == 6
    path.write_text(json.dumps(sweep_doc(6, [], mode="closed")))
    with pytest.raises(ConfigError, match="live chats.*--max-in-flight"):
        knee_cap(path)
    path.write_text(json.dumps(sweep_doc(6, [], mode="open")))
    with pytest.raises(ConfigError, match="open-loop"):
        knee_cap(path)
    # 1 live chat that pauses most of the time: less than one request in flight
    path.write_text(json.dumps(sweep_doc(1, [closed_loop_run(1, 0.2, 2.0, window_s=40.0)])))
    with pytest.raises(ConfigError, match="no usable cap"):
        knee_cap(path)


def test_gateway_caps_from_a_closed_sweep_are_in_flight_requests(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(sweep_doc(12, [closed_loop_run(12, 1.0, 2.0, window_s=60.0)])))
    cfg = build_gateway_config(Profile(), ["http://r:1"], {}, path)
    assert cfg.max_in_flight == knee_cap(path).cap < 12
