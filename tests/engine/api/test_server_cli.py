"""`chatfleet engine` as a real subprocess: serves, answers the openai client, stops on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai

from chatfleet.loopback import free_port

CLI = [sys.executable, "-m", "chatfleet.cli.main", "engine"]


def test_engine_command_serves_and_stops_cleanly():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        CLI + ["--model", "tiny", "--port", str(port), "--threads", "1", "--kv-cache-tokens", "2048",
               "--max-model-len", "512", "--served-model-name", "chat-tiny", "--no-prefix-cache",
               "--no-chunked-prefill",
               "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not become healthy"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["chat-tiny"]
        prompt = [{"role": "user", "content": " ".join(["repeat"] * 60)}]
        for _ in range(2):
            r = client.chat.completions.create(model="chat-tiny", messages=prompt, max_tokens=3,
                                               extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 3
            assert r.usage.prompt_tokens_details.cached_tokens == 0  # --no-prefix-cache
        assert "vllm:kv_cache_usage_perc" in httpx.get(url + "/metrics").text
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0


def test_engine_command_rejects_bad_flags():
    r = subprocess.run(CLI + ["--kv-cache-memory", "lots"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot parse memory size" in r.stderr
