"""`chatfleet bench` and `sweep` with default flags against a chatfleet gateway (what `serve`
puts in front of its engines): the gateway resets every replica's prefix cache and the probe
verifies the flush through it; a replica that keeps its cache fails the run. A gateway that does
not pass the reset on (an older one: its reset answers 404) lets the run go ahead and says what
it verified and what not, with no hint about engine flags."""

import asyncio
import json

import pytest
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.gateway.app import create_app
from chatfleet.gateway.config import GatewayConfig
from chatfleet.loopback import ServerThread
from chatfleet.testing.fake_server import FakeBehavior, FakeServer


def _gateway(**behavior):
    replica = ServerThread(FakeServer(FakeBehavior(ttft_s=0.002, interval_s=0.001, **behavior))).start()
    gateway = ServerThread(create_app(GatewayConfig(replicas=(replica.url,), port=0, health_interval_s=0.2,
                                                    log_requests=False))).start()
    return replica, gateway


@pytest.fixture
def gateway_url():
    replica, gateway = _gateway()
    try:
        yield gateway.url
    finally:
        gateway.stop()
        replica.stop()


def test_bench_and_sweep_through_a_gateway_verify_the_fleet_reset(gateway_url, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--url", gateway_url, "--level", "2", "--mode", "concurrency",
                                 "--duration", "0.4", "--warmup", "0", "--out", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert "is a chatfleet gateway" not in text and "--enable-admin-api" not in text
    run = json.loads((tmp_path / "b.json").read_text())["series"][gateway_url]["points"][0]["runs"][0]
    assert run["reset"]["method"] == "usage" and run["reset"]["cached_before"] > 0
    assert run["reset"]["cached_after"] == 0 and run["summary"]["ok"] > 0
    r = CliRunner().invoke(app, ["sweep", "--url", gateway_url, "--mode", "concurrency", "--slo", "itl_p50<=1s",
                                 "--start", "1", "--max", "2", "--duration", "0.3", "--warmup", "0"])
    assert r.exit_code == 0, r.output  # each run's reset verified through the gateway
    assert "is a chatfleet gateway" not in " ".join(r.output.split())


def test_a_replica_that_keeps_its_cache_fails_the_run_through_the_gateway(tmp_path):
    replica, gateway = _gateway(broken_reset=True)  # answers the reset 200 and keeps the cache
    try:
        r = CliRunner().invoke(app, ["bench", "--url", gateway.url, "--level", "1", "--mode", "concurrency",
                                     "--duration", "0.3", "--warmup", "0", "--out", str(tmp_path / "b.json")])
    finally:
        gateway.stop()
        replica.stop()
    assert r.exit_code != 0
    assert "did not empty the cache" in " ".join(r.output.split())


def test_bench_and_sweep_against_a_gateway_that_does_not_reset_say_what_is_verified(gateway_url, tmp_path,
                                                                                     monkeypatch):
    from chatfleet.bench import server_ops

    monkeypatch.setitem(server_ops.RESET_PATHS, "chatfleet", "/no-such-reset")  # an older gateway: 404
    runner = CliRunner()
    r = runner.invoke(app, ["bench", "--url", gateway_url, "--level", "2", "--mode", "concurrency",
                            "--duration", "0.4", "--warmup", "0", "--out", str(tmp_path / "b.json")])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # the console wraps at its width
    assert "is a chatfleet gateway" in text and "Not verified: a cold start per run" in text
    assert "--enable-admin-api" not in text
    run = json.loads((tmp_path / "b.json").read_text())["series"][gateway_url]["points"][0]["runs"][0]
    assert run["reset"]["method"] == "not-reset" and run["summary"]["ok"] > 0

    r = runner.invoke(app, ["sweep", "--url", gateway_url, "--mode", "concurrency", "--slo", "itl_p50<=1s",
                            "--start", "1", "--max", "2", "--duration", "0.3", "--warmup", "0",
                            "--no-verify-reset"])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())
    assert text.count("is a chatfleet gateway") == 1 and "--enable-admin-api" not in text


def test_a_plain_server_without_the_reset_is_not_taken_for_a_gateway(scripted, monkeypatch):
    """Not a gateway: a 404 on the reset is the server's own, and the error keeps its flag hint."""
    from chatfleet.bench import server_ops

    monkeypatch.setitem(server_ops.RESET_PATHS, "chatfleet", "/no-such-reset")  # answered 404

    async def go(url):
        c = server_ops.ServerControl(url, "scripted")
        try:
            assert not await c.is_gateway()
            with pytest.raises(server_ops.ResetError, match="--enable-admin-api") as err:
                await c.reset()
            assert not isinstance(err.value, server_ops.GatewayCannotReset)
        finally:
            await c.close()

    asyncio.run(go(scripted()))
