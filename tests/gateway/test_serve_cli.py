"""`chatfleet serve`: a whole local fleet in one command, shut down cleanly by a signal."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest
from gateway_helpers import wait_for
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.loopback import free_port


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "chatfleet.cli.main", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def stop(proc: subprocess.Popen, sig: int) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    return out


def test_serve_starts_engines_and_a_sigterm_stops_all(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["serve", "--replicas", "1", "--model", "tiny", "--port", str(port),
                  "--threads-per-replica", "1", "--engine-arg=--kv-cache-tokens=4096"])
    try:
        wait_for(lambda: healthy(url) or proc.poll() is not None, timeout=180, what="serve to come up")
        assert proc.poll() is None, proc.communicate()[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", max_tokens=3,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens >= 1
        (state,) = httpx.get(url + "/gateway/status").json()["replicas"]
        engine, pid = state["url"], state["process"]["pid"]
        assert healthy(engine) and state["process"]["running"]
        os.kill(pid, signal.SIGKILL)  # the replica dies: serve starts it again on its port

        def restarted():
            (now,) = httpx.get(url + "/gateway/status").json()["replicas"]
            return now["process"]["restarts"] == 1 and now["healthy"] and healthy(engine) and now

        now = wait_for(restarted, timeout=180, what="the engine to be restarted")
        assert now["process"]["pid"] != pid and now["process"]["last_exit_code"] == -signal.SIGKILL
        reply = client.chat.completions.create(model="tiny", max_tokens=2,
                                               messages=[{"role": "user", "content": "again"}])
        assert reply.usage.completion_tokens >= 1
    finally:
        out = stop(proc, signal.SIGTERM)
    assert proc.returncode == 0, out
    assert not healthy(engine) and not healthy(url)  # the engine went down with the gateway
    assert '"msg":"request"' in out  # JSON request log
    assert f"clients use base URL {url}/v1" in out
    assert '"msg":"replica process exited"' in out and '"msg":"replica process restarted"' in out


def test_serve_attaches_existing_replicas_with_caps_from_a_sweep(tmp_path, fakes):
    (fake,) = fakes(1)
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"knee": 7}))
    profile = tmp_path / "fleet.yaml"
    profile.write_text("gateway:\n  queue_size: 5\n  session_header: X-Chat\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(["serve", "--replica", fake.url, "--port", str(port), "--caps-from", str(sweep),
                  "--profile", str(profile)])
    try:
        wait_for(lambda: healthy(url) or proc.poll() is not None, timeout=60, what="serve to come up")
        status = httpx.get(url + "/gateway/status").json()
        assert [(r["url"], r["cap"]) for r in status["replicas"]] == [(fake.url, 7)]
        r = httpx.post(url + "/v1/chat/completions", headers={"X-Chat": "c1"},
                       json={"model": "fake", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        assert fake.replica.stats.requests[-1]["headers"]["x-chat"] == "c1"
    finally:
        out = stop(proc, signal.SIGINT)
    assert proc.returncode == 0, out


def test_serve_checks_its_port_before_starting_engines():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["serve", "--replicas", "1", "--model", "/no/such/model",
                                          "--port", str(port)])
    assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output, result.output


@pytest.mark.parametrize("args, message", [
    (["gateway"], "no replicas"),
    (["gateway", "--replica", "http://a:1", "--max-in-flight", "2", "--caps-from", "x.json"], "either"),
    (["serve", "--replicas", "0"], "nothing to serve"),
    (["serve", "--engine-arg=--port=9"], "set by the fleet"),
])
def test_bad_command_lines_fail_clearly(args, message):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output
