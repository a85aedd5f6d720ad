import pytest

from chatfleet.bench.slo import parse_slo
from chatfleet.errors import ConfigError


def test_parses_both_examples():
    slo = parse_slo("ttft_p99<=1s,itl_p99<=100ms")
    assert [(t.metric, t.stat, t.threshold_s) for t in slo.targets] == [("ttft", "p99", 1.0), ("itl", "p99", 0.1)]
    slo = parse_slo("reply_p50<=3.8s, reply_p95<=7s")
    assert [t.key for t in slo.targets] == ["reply_p50", "reply_p95"]
    assert str(slo) == "reply_p50<=3.8s,reply_p95<=7s"
    assert parse_slo("ttft_p99.9<250us").targets[0].strict


@pytest.mark.parametrize("bad, words", [
    ("", "empty"), ("ttft<=1s", "cannot parse"), ("latency_p99<=1s", "unknown SLO metric"),
    ("ttft_p99<=1h", "cannot parse"), ("ttft_p99<=1s,ttft_p99<=2s", "twice"), ("ttft_p0<=1s", "percentile"),
])
def test_bad_slo_is_a_clear_error(bad, words):
    with pytest.raises(ConfigError, match=words):
        parse_slo(bad)


def test_request_check_uses_own_itl_percentile():
    slo = parse_slo("ttft_p99<=1s,itl_p50<=100ms")
    assert slo.request_ok({"ttft": 0.5, "itl": [0.05, 0.05, 0.5]})
    assert not slo.request_ok({"ttft": 0.5, "itl": [0.5, 0.5, 0.05]})
    assert not slo.request_ok({"ttft": 1.5, "itl": []})
    assert not slo.request_ok({"ttft": None, "itl": []})
