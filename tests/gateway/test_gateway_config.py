"""GatewayConfig validation, YAML profiles and caps read from a sweep result."""

from __future__ import annotations

import json

import pytest

from chatfleet.errors import ConfigError
from chatfleet.gateway.config import GatewayConfig, ReplicaSpec, load_profile
from chatfleet.gateway.knee import read_knee


def test_replica_urls_are_normalized_and_must_be_distinct():
    cfg = GatewayConfig(replicas=("localhost:8001/", "http://h:8002/v1", {"url": "h:9", "max_in_flight": 4}))
    assert [r.url for r in cfg.replicas] == ["http://localhost:8001", "http://h:8002", "http://h:9"]
    assert cfg.cap_of(cfg.replicas[2]) == 4 and cfg.cap_of(cfg.replicas[0]) is None
    with pytest.raises(ConfigError, match="distinct"):
        GatewayConfig(replicas=("h:1", "http://h:1/"))
    with pytest.raises(ConfigError, match="URL"):
        ReplicaSpec("ftp://x")


@pytest.mark.parametrize("field, value, message", [
    ("load_factor", 1.0, "load_factor"),
    ("max_in_flight", 0, "max_in_flight"),
    ("queue_size", -1, "queue_size"),
    ("routing_policy", "nope", "bounded_load"),
    ("read_timeout_s", 0, "read_timeout_s"),
    ("api_keys", ("",), "api keys"),
    ("total_timeout_s", 0, "total_timeout_s"),
    ("connect_timeout_s", -1, "connect_timeout_s"),
    ("max_queued_new", 5000, "max_queued_new"),
    ("session_ttl_s", 0, "session_ttl_s"),
])
def test_bad_values_fail_clearly(field, value, message):
    with pytest.raises(ConfigError, match=message):
        GatewayConfig(**{field: value})


def test_profile_sections(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text(
        "gateway:\n  max_in_flight: 8\n  replicas: [http://a:1, {url: http://b:2, max_in_flight: 3}]\n"
        "serve:\n  replicas: 2\nengine:\n  kv_cache_tokens: 4096\n"
    )
    profile = load_profile(path)
    cfg = GatewayConfig.from_dict(profile.gateway)
    assert [cfg.cap_of(r) for r in cfg.replicas] == [8, 3]
    assert profile.serve == {"replicas": 2} and profile.engine == {"kv_cache_tokens": 4096}


def test_profile_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gatway: {}\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_profile(bad)
    with pytest.raises(ConfigError, match="unknown gateway setting.*max_inflight"):
        GatewayConfig.from_dict({"max_inflight": 3})
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.yaml")


def test_knee_from_a_sweep_result(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"knee": 24.7, "points": []}))
    assert read_knee(path) == 24
    path.write_text(json.dumps({"knee": {"concurrency": 12, "ttft_p99_s": 0.8}}))
    assert read_knee(path) == 12
    path.write_text(json.dumps({"points": []}))
    with pytest.raises(ConfigError, match="knee"):
        read_knee(path)


def test_knee_from_the_series_of_a_sweep_document(tmp_path):
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"format": "chatfleet.bench", "series": {"http://r:1": {"knee": 16.0}}}))
    assert read_knee(path) == 16
    path.write_text(json.dumps({"series": {"stock": {"knee": 4}, "tuned": {"knee": 11}}}))
    with pytest.raises(ConfigError, match="several series"):
        read_knee(path)
    assert read_knee(path, series="tuned") == 11
    with pytest.raises(ConfigError, match="no series 'x'"):
        read_knee(path, series="x")
    path.write_text(json.dumps({"series": {"a": {"knee": None}}}))
    with pytest.raises(ConfigError, match="no numeric knee"):
        read_knee(path)


def test_upstream_timeouts_and_shedding_settings_come_from_flags():
    from chatfleet.cli.gateway_cmd import _flags, build_gateway_config
    from chatfleet.gateway.config import Profile

    flags = _flags(None, None, None, 64, None, None, None, None, None, connect_timeout=1.5,
                   read_timeout=20, total_timeout=90, max_body_bytes=1 << 20, max_queued_new=8,
                   session_ttl=120)
    cfg = build_gateway_config(Profile(gateway={"connect_timeout_s": 3}), ["h:1"], flags, None)
    assert (cfg.connect_timeout_s, cfg.read_timeout_s, cfg.total_timeout_s) == (1.5, 20, 90)
    assert (cfg.max_body_bytes, cfg.new_queue_limit, cfg.session_ttl_s) == (1 << 20, 8, 120)
    assert GatewayConfig(queue_size=64).new_queue_limit == 32 and GatewayConfig().total_timeout_s is None
