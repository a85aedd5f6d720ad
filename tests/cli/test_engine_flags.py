"""`chatfleet engine` KV-tier flags reach the engine config; bad values fail with a clear message."""

from typer.testing import CliRunner

from chatfleet.cli.main import app


def test_tier_and_policy_flags_build_the_config(monkeypatch):
    seen = {}
    monkeypatch.setattr("chatfleet.engine.api.server.run_server", lambda config, **kw: seen.update(config=config))
    result = CliRunner().invoke(app, [
        "engine", "--model", "tiny", "--host-cache-memory", "2GiB", "--eviction-policy", "session",
        "--host-eviction-policy", "lfu", "--scheduling-policy", "lpm", "--max-queue-delay", "3.5",
        "--lpm-host-weight", "0.25",
    ])
    assert result.exit_code == 0, result.output
    cache, sched = seen["config"].cache, seen["config"].scheduler
    assert (cache.host_memory_bytes, cache.eviction_policy, cache.host_eviction_policy) == (2 << 30, "session", "lfu")
    assert (sched.policy, sched.max_queue_delay, sched.lpm_host_weight) == ("lpm", 3.5, 0.25)


def test_bad_tier_flags_exit_with_a_message():
    runner = CliRunner()
    result = runner.invoke(app, ["engine", "--scheduling-policy", "sjf"])
    assert result.exit_code == 2 and "valid: fcfs, lpm" in result.output
    result = runner.invoke(app, ["engine", "--host-cache-memory", "1GiB", "--no-prefix-cache"])
    assert result.exit_code == 2 and "needs prefix caching" in result.output
