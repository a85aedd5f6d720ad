import math

import pytest

from chatfleet.bench.fleet import plan_fleet
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.stats import confidence_interval, summarize
from chatfleet.errors import ConfigError


def rec(ttft, itl=(0.01,), status="ok", turn=0, prompt=100, cached=0, warmup=False):
    return RequestRecord(0, turn, 0, 0, 0.0, ttft_s=ttft, reply_s=(ttft or 0) + sum(itl), itl_s=list(itl),
                         output_tokens=len(itl) + 1, status=status, prompt_tokens=prompt, cached_tokens=cached,
                         warmup=warmup)


def test_goodput_counts_only_requests_meeting_every_target():
    recs = [rec(0.1), rec(0.2), rec(2.0), rec(0.1, itl=(0.5, 0.5)), rec(5.0, warmup=True)]
    s = summarize(recs, parse_slo("ttft_p50<=1s,itl_p50<=100ms"), window_s=2.0)
    assert s.requests == 4  # the warmup one is left out
    assert s.goodput == pytest.approx(1.0)  # two of four in 2 s
    assert s.slo_attainment == pytest.approx(0.5)


def test_errors_count_as_infinitely_slow_and_are_kept():
    recs = [rec(0.1) for _ in range(9)] + [rec(None, itl=(), status="error")]
    s = summarize(recs, parse_slo("ttft_p99<=1s"), window_s=1.0)
    assert s.errors == 1 and s.requests == 10
    assert math.isinf(s.latency["ttft"]["p99"]) and not s.slo_passed
    s = summarize(recs, parse_slo("ttft_p50<=1s"), window_s=1.0)
    assert s.slo_passed


def test_hit_rate_by_turn():
    recs = [rec(0.1, turn=0, prompt=100, cached=0), rec(0.1, turn=1, prompt=200, cached=150),
            rec(0.1, turn=1, prompt=200, cached=50)]
    s = summarize(recs, None, 1.0)
    assert s.hits_by_turn[0].hit_rate == 0.0 and s.hits_by_turn[1].hit_rate == pytest.approx(0.5)
    assert s.hit_rate == pytest.approx(200 / 500)


def test_confidence_interval():
    iv = confidence_interval([10.0, 12.0, 14.0])
    assert iv.mean == pytest.approx(12.0) and iv.low < 12 < iv.high and iv.n == 3
    assert confidence_interval([3.0]).low == 3.0


def test_fleet_size_and_cost():
    f = plan_fleet(knee=37, peak_chats=2200, headroom=0.0, price_per_gpu_hour=2.0)
    assert f.replicas == 60 and f.gpus == 60  # ceil(2200 / 37) = 60
    assert f.cost_per_conversation_hour == pytest.approx(120 / 2200)
    assert plan_fleet(100, 2200, headroom=0.2).replicas == 27  # ceil(2640 / 100)
    assert plan_fleet(2200, 2200).replicas == 1
    with pytest.raises(ConfigError, match="no knee"):
        plan_fleet(None, 2200)
    with pytest.raises(ConfigError):
        plan_fleet(10, 0)
