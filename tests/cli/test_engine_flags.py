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


def test_server_flags_build_the_server_options(monkeypatch):
    seen = {}
    monkeypatch.setattr("chatfleet.engine.api.server.run_server", lambda config, **kw: seen.update(kw))
    monkeypatch.setenv("CHATFLEET_API_KEY", "from-env")
    result = CliRunner().invoke(app, ["engine", "--model", "tiny", "--max-body-bytes", "65536",
                                      "--request-timeout", "30", "--enable-admin-api"])
    assert result.exit_code == 0, result.output
    opts = seen["options"]
    assert (opts.max_body_bytes, opts.request_timeout_s, opts.enable_admin_api) == (65536, 30.0, True)
    assert opts.api_keys == ("from-env",)
    result = CliRunner().invoke(app, ["engine", "--model", "tiny", "--api-key", "k1,k2"])
    assert result.exit_code == 0 and seen["options"].api_keys == ("k1", "k2")
    result = CliRunner().invoke(app, ["engine", "--request-timeout", "0"])
    assert result.exit_code == 2 and "request timeout" in result.output
