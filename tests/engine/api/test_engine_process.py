"""The engine core in its own process (``EngineProcess``) against the engine on a thread of the
server's process (``AsyncEngine``), the oracle: same replies, same refusals, blocks freed on
disconnect, structured output, and what happens when either process dies."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.engine_process import EngineProcess
from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.api.server import build_app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.errors import ChatfleetError, EngineDeadError
from chatfleet.loopback import ServerThread, free_port

CONFIG = EngineConfig(model="tiny", num_threads=1, max_model_len=1024,
                      cache=CacheConfig(block_size=16, num_tokens=8192),
                      scheduler=SchedulerConfig(max_batched_tokens=256))
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["Tell me a story about a lighthouse keeper.", "Bonjour, comment vas-tu ?", "1, 2, 3, 4,",
           "Write a haiku about rain.", "¿Dónde está la biblioteca?", "def fib(n):"]


@pytest.fixture(scope="module")
def servers():
    """(core process server, thread server) over the same config."""
    from chatfleet.engine.engine import Engine

    resolve_model("tiny")
    process = EngineProcess(CONFIG, check_integrity_when_idle=True)
    thread = AsyncEngine(Engine(CONFIG), check_integrity_when_idle=True)
    options = ServerOptions(enable_admin_api=True)
    with ServerThread(build_app(process, options=options)) as srv_p, \
            ServerThread(build_app(thread, options=options)) as srv_t:
        srv_p.engine, srv_t.engine = process, thread
        yield srv_p, srv_t


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def replies(server, max_tokens: int = 24) -> list[tuple[str, int, str]]:
    """Each prompt's greedy reply (text, tokens, finish reason), the requests sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    c = client(server)

    def one(i_prompt: tuple[int, str]) -> tuple[str, int, str]:
        i, prompt = i_prompt
        if i % 2:  # half streamed
            text, n, reason = "", 0, ""
            for chunk in c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=max_tokens, stream=True,
                                                   stream_options={"include_usage": True}, **GREEDY):
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
            return text, n, reason
        r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                      max_tokens=max_tokens, **GREEDY)
        return r.choices[0].message.content or "", r.usage.completion_tokens, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, enumerate(PROMPTS)))


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_greedy_replies_equal_the_in_process_engines(servers):
    srv_p, srv_t = servers
    got, want = replies(srv_p), replies(srv_t)
    assert got == want
    assert all(text and reason == "length" for text, _, reason in got)


def test_refusals_are_the_same(servers):
    srv_p, srv_t = servers
    bodies = [
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        {"model": "tiny", "prompt": [0, 1, 10**6], "max_tokens": 2},
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
    ]
    for body in bodies:
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        a, b = httpx.post(srv_p.url + path, json=body, timeout=30), httpx.post(srv_t.url + path, json=body, timeout=30)
        assert a.status_code == b.status_code and a.status_code >= 400, (body, a.text)
        assert a.json() == b.json()
    assert httpx.get(srv_p.url + "/health").status_code == 200


def test_a_client_that_leaves_frees_its_blocks(servers):
    srv_p, _ = servers
    with httpx.stream("POST", srv_p.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": [{"role": "user", "content": "go on and on"}], "max_tokens": 900,
            "stream": True, "ignore_eos": True, "temperature": 0.0}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 30
    while (metric(srv_p, "vllm:num_requests_running") or metric(srv_p, "vllm:kv_cache_usage_perc")) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(srv_p, "vllm:num_requests_running") == 0
    assert metric(srv_p, "vllm:kv_cache_usage_perc") == 0
    asyncio.run(srv_p.engine.check_integrity())  # the core's own check of its pool and scheduler


def test_structured_output_through_the_core(servers):
    srv_p, _ = servers
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client(srv_p).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "who?"}], max_tokens=200, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "who", "schema": schema, "strict": True}})
    if r.choices[0].finish_reason == "stop":
        value = json.loads(r.choices[0].message.content)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    else:
        assert r.choices[0].finish_reason == "length"


def test_a_refused_load_raises_the_engines_error():
    from chatfleet.engine.engine import Engine

    bad = EngineConfig(model="tiny", max_model_len=10**7)
    with pytest.raises(ChatfleetError) as in_thread:
        Engine(bad)
    with pytest.raises(ChatfleetError) as in_process:
        EngineProcess(bad)
    assert type(in_process.value) is type(in_thread.value)
    assert in_process.value.message == in_thread.value.message


def test_a_dead_core_fails_open_streams_and_health():
    engine = EngineProcess(CONFIG)
    with ServerThread(build_app(engine)) as srv:
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=30, json={
                "model": "tiny", "prompt": "x", "max_tokens": 900, "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine.core_pid, signal.SIGKILL)
            rest = "\n".join(lines)  # the stream ends, with an error event
        assert "error" in rest
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(srv.url + "/health").status_code == 503
        again = httpx.post(srv.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert again.status_code == 500  # EngineDeadError, as the thread engine answers after its loop died
        assert "engine loop stopped" in again.json()["error"]["message"]
        assert isinstance(engine.dead_error, EngineDeadError)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _running(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    try:
        return "zombie" not in status.read_text()
    except FileNotFoundError:
        return False


def _start_engine_command(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """``python -m chatfleet.engine`` on the tiny model, healthy (its log in tmp_path/engine.log)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "chatfleet.engine", "--model", str(resolve_model("tiny")),
                             "--port", str(port), "--threads", "1", "--kv-cache-tokens", "4096",
                             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "engine.log", "w"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError((tmp_path / "engine.log").read_text())


def test_the_core_exits_when_the_api_process_dies(tmp_path):
    proc, port = _start_engine_command(tmp_path)
    try:
        spawned = [c for c in _children(proc.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert spawned  # the engine core (and the tokenizing worker)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while any(_running(c) for c in spawned) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(c) for c in spawned)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_server_exits_with_status_1_when_its_core_dies(tmp_path):
    """After a dead core the server answers 503 for a moment, then exits for its supervisor
    (``chatfleet serve``, Kubernetes) to start a new one, as vLLM's API server does."""
    from chatfleet.engine.api.core_process import CORE_PROCESS_NAME

    proc, port = _start_engine_command(tmp_path)
    try:
        cores = [c for c in _children(proc.pid)
                 if Path(f"/proc/{c}/comm").read_text().strip() == CORE_PROCESS_NAME]
        assert len(cores) == 1, "the core process names itself"
        os.kill(cores[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 503
        assert proc.wait(30) == 1
        assert "the engine is dead" in (tmp_path / "engine.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
