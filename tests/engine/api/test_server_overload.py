"""A full waiting queue answers 503 in OpenAI error format; the server recovers."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.api.server import build_app
from chatfleet.loopback import ServerThread


@pytest.fixture(scope="module")
def server():
    from chatfleet.engine.engine import Engine

    torch.set_num_threads(1)
    config = EngineConfig(
        model="tiny", num_threads=1, max_model_len=1024,
        cache=CacheConfig(num_tokens=4096),
        scheduler=SchedulerConfig(max_running=1, max_waiting=1),
    )
    engine = AsyncEngine(Engine(config), check_integrity_when_idle=True)
    with ServerThread(build_app(engine)) as srv:
        srv.engine = engine
        yield srv


def stats(server):
    return server.engine.call_threadsafe(lambda e: e.stats()).result(timeout=30)


def body(max_tokens, stream):
    return {"messages": [{"role": "user", "content": "go on"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": stream}


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_queue_full_gets_503_then_recovers(server):
    url = server.url + "/v1/chat/completions"
    with httpx.Client(timeout=60) as c, c.stream("POST", url, json=body(900, True)) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # keep a reference: a dropped iterator closes the connection
        next(lines)
        waiting_result = {}

        def waiting_request():
            waiting_result["r"] = httpx.post(url, json=body(3, False), timeout=60)

        t = threading.Thread(target=waiting_request)
        t.start()
        assert wait_for(lambda: stats(server).num_waiting == 1)

        r = httpx.post(url, json=body(3, False), timeout=30)
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["type"] == "server_overloaded" and err["code"] == "queue_full" and err["message"]
        assert 'vllm:num_requests_waiting{model_name="tiny"} 1.0' in httpx.get(server.url + "/metrics").text
    # The running stream is closed (aborted): the waiting request now runs to its end.
    t.join(60)
    assert waiting_result["r"].status_code == 200
    assert waiting_result["r"].json()["usage"]["completion_tokens"] == 3
    assert wait_for(lambda: stats(server).kv_usage == 0 and stats(server).num_running == 0)
    assert httpx.get(server.url + "/health").status_code == 200
    assert 'chatfleet:requests_rejected_total{model_name="tiny",status="503"} 1.0' in httpx.get(
        server.url + "/metrics").text
