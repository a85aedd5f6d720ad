"""Hit rate and TTFT by turn and by pause against hand-computed fixtures."""

import math

import pytest

from chatfleet.bench.breakdown import FIRST_TURN, Breakdown, breakdown, by_pause, by_turn, pause_bin, request_hit_rate
from chatfleet.bench.records import RequestRecord


def rec(turn, pause, ttft, prompt, cached, status="ok", warmup=False):
    return RequestRecord(0, turn, 0, 0, 0.0, ttft_s=ttft, status=status, prompt_tokens=prompt, cached_tokens=cached,
                         pause_s=pause, warmup=warmup)


RECORDS = [
    rec(0, None, 0.10, 100, 0),
    rec(0, None, 0.30, 300, 150),
    rec(1, 0.7, 0.20, 200, 150),  # pause bin 0.5-1s
    rec(1, 3.0, 0.40, 400, 100),  # 2-4s
    rec(2, 3.9, 0.50, 500, 0),  # 2-4s
    rec(2, 100.0, None, None, None, status="error"),  # >=64s, failed: infinitely slow
    rec(3, 0.2, 9.9, 1000, 1000, warmup=True),  # left out
]


def test_request_hit_rate_from_cached_tokens():
    assert request_hit_rate(RECORDS[1]) == 0.5
    assert request_hit_rate(RECORDS[5]) is None  # failed: no usage
    assert request_hit_rate(rec(1, 1.0, 0.1, 10, None)) is None  # server did not report cached tokens


def test_pause_bins_double_in_width():
    assert pause_bin(None) == (FIRST_TURN, -1.0)
    assert pause_bin(0.2)[0] == "0-0.5s"
    assert pause_bin(0.5)[0] == "0.5-1s"  # lower edge inclusive
    assert pause_bin(3.99)[0] == "2-4s"
    assert pause_bin(64.0)[0] == ">=64s"


def test_by_turn_hand_computed():
    groups = {g.key: g for g in by_turn(RECORDS)}
    assert list(groups) == ["0", "1", "2"]  # the warmup turn 3 is left out
    t0, t1, t2 = groups["0"], groups["1"], groups["2"]
    assert (t0.requests, t0.prompt_tokens, t0.cached_tokens) == (2, 400, 150)
    assert t0.hit_rate == pytest.approx(150 / 400)  # token-weighted
    assert t0.request_hit_rate == pytest.approx((0.0 + 0.5) / 2)  # mean of per-request rates
    assert t0.ttft_p50 == pytest.approx(0.10) and t0.ttft_p95 == pytest.approx(0.30)  # nearest rank
    assert t1.hit_rate == pytest.approx(250 / 600) and t1.request_hit_rate == pytest.approx((0.75 + 0.25) / 2)
    assert t1.ttft_mean == pytest.approx(0.30)
    assert t2.requests == 2 and t2.failed == 1 and t2.hit_rate == 0.0
    assert math.isinf(t2.ttft_p95) and t2.ttft_mean == pytest.approx(0.5)  # failures count as infinitely slow


def test_by_pause_hand_computed():
    groups = by_pause(RECORDS)
    assert [g.key for g in groups] == [FIRST_TURN, "0.5-1s", "2-4s", ">=64s"]  # ordered by the bin's edge
    g = {x.key: x for x in groups}
    assert g[FIRST_TURN].requests == 2
    assert g["0.5-1s"].hit_rate == pytest.approx(0.75)
    assert g["2-4s"].requests == 2 and g["2-4s"].hit_rate == pytest.approx(100 / 900)
    assert g["2-4s"].request_hit_rate == pytest.approx((0.25 + 0.0) / 2)
    assert g[">=64s"].failed == 1 and g[">=64s"].hit_rate is None


def test_breakdown_round_trips_through_json_dicts():
    bd = breakdown(RECORDS)
    again = Breakdown.from_dict(bd.to_dict())
    assert again == bd
