"""The knee's spread over repeats, and the tuned engine's flags from the fields its config has."""

from types import SimpleNamespace

import pytest

from chatfleet.bench import techniques
from chatfleet.bench.knee import knee_spread
from chatfleet.bench.techniques import TECHNIQUES, TechniqueSettings, engine_args
from chatfleet.errors import ConfigError


def point(level, passed_by_repeat):
    runs = [SimpleNamespace(summary=SimpleNamespace(slo_passed=p), throttled=False) for p in passed_by_repeat]
    return SimpleNamespace(level=level, kept=runs)


def test_knee_per_repeat_is_the_highest_load_passing_with_all_lower_ones():
    pts = [point(8, [True, False]), point(2, [True, True]), point(4, [True, True]), point(6, [False, True])]
    spread = knee_spread(pts)
    assert spread.knees == (4, 6)  # repeat 0 broke at 6; repeat 1 broke at 8
    assert (spread.low, spread.high) == (4, 6)
    spread = knee_spread([point(2, [False, True]), point(4, [True, True])])
    assert spread.knees == (None, 4) and spread.low == 0 and spread.high == 4
    assert "0-4 over 2 repeats" in spread.describe()


def test_missing_techniques_are_named_not_dropped(monkeypatch):
    monkeypatch.setattr(techniques, "engine_fields", lambda: frozenset({"scheduler.max_running"}))
    a = engine_args(TECHNIQUES, TechniqueSettings(max_running=3), ("--kv-cache-tokens", "2048"))
    assert a.args == ("--kv-cache-tokens", "2048", "--max-running", "3")
    assert a.applied == ("cap",) and set(a.missing) == {"host_tier", "session_eviction"}
    assert "not in this engine yet" in a.describe()


def test_techniques_the_engine_accepts_become_flags(monkeypatch):
    fields = {"scheduler.max_running", "cache.host_memory_bytes", "cache.eviction_policy",
              "cache.host_eviction_policy", "scheduler.policy", "scheduler.max_queue_delay"}
    monkeypatch.setattr(techniques, "engine_fields", lambda: frozenset(fields))
    monkeypatch.setattr(techniques, "_policy_known", lambda kind, name: True)
    a = engine_args((*TECHNIQUES, "lpm"), TechniqueSettings(host_cache_memory="64MiB", max_queue_delay_s=1.5))
    assert a.missing == () and a.applied == (*TECHNIQUES, "lpm")
    assert "--host-cache-memory" in a.args and a.args[a.args.index("--host-cache-memory") + 1] == "64MiB"
    assert a.args[a.args.index("--eviction-policy") + 1] == "session"
    assert a.args[a.args.index("--scheduling-policy") + 1] == "lpm"
    assert a.args[a.args.index("--max-queue-delay") + 1] == "1.5"
    with pytest.raises(ConfigError, match="unknown technique"):
        engine_args(("turbo",), TechniqueSettings())


def test_engine_fields_read_from_the_engine_config():
    assert {"cache.num_tokens", "scheduler.max_running", "cache.enable_prefix_caching"} <= techniques.engine_fields()
    tuned = engine_args(TECHNIQUES, TechniqueSettings())
    assert tuned.missing == () and tuned.applied == TECHNIQUES  # this build has every technique


def test_fp8_kv_is_opt_in_and_its_flags_parse_as_an_fp8_engine():
    from chatfleet.engine.argv import parse_engine_argv

    assert "fp8_kv" not in TECHNIQUES and "lpm" not in TECHNIQUES  # never in the tuned default
    assert "--scheduling-policy" not in engine_args(TECHNIQUES, TechniqueSettings()).args  # tuned: fcfs
    assert techniques.series_techniques("all") == TECHNIQUES and techniques.series_techniques("stock") == ()
    assert techniques.series_techniques("all_fp8") == (*TECHNIQUES, "fp8_kv")
    assert techniques.series_techniques("lpm") == ("lpm",)  # any other series: that technique alone
    a = engine_args((*TECHNIQUES, "fp8_kv"), TechniqueSettings(kv_scales_from_prompts=256),
                    ("--kv-cache-memory", "25165824"))
    assert a.missing == () and a.applied[-1] == "fp8_kv"
    assert a.args[a.args.index("--kv-cache-dtype") + 1] == "fp8"
    config, _ = parse_engine_argv(["--model", "tiny", *a.args])
    assert config.resolved_kv_cache_dtype == "fp8" and config.kv_scales_from_prompts == 256
    assert config.cache.memory_bytes == 25165824
    with pytest.raises(ConfigError):
        TechniqueSettings(kv_scales_from_prompts=0)
