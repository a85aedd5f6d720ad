"""A full waiting queue answers 503 in OpenAI error format; the server recovers."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.server import build_app
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
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


def test_a_burst_admits_exactly_max_running_plus_max_waiting():
    """16 requests at once against --max-running 2 --max-waiting 2: 4 admitted, 12 refused at
    once with 503 and Retry-After (requests added between two steps count against free slots)."""
    import asyncio

    from chatfleet.engine.engine import Engine

    config = EngineConfig(model="tiny", num_threads=1, max_model_len=1024, cache=CacheConfig(num_tokens=4096),
                          scheduler=SchedulerConfig(max_running=2, max_waiting=2))
    engine = AsyncEngine(Engine(config))

    async def burst(url: str) -> tuple[list[httpx.Response], int]:
        async with httpx.AsyncClient(timeout=60) as client:
            tasks = [asyncio.create_task(client.post(url, json=body(800, False))) for _ in range(16)]
            refused: list[httpx.Response] = []
            for done in asyncio.as_completed(tasks):
                r = await done
                refused.append(r)
                if len(refused) == 12:
                    break
            in_engine = await asyncio.to_thread(lambda: stats(srv).num_running + stats(srv).num_waiting)
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return refused, len(pending), in_engine

    with ServerThread(build_app(engine)) as srv:
        srv.engine = engine
        refused, pending, in_engine = asyncio.run(burst(srv.url + "/v1/chat/completions"))
        assert [r.status_code for r in refused] == [503] * 12
        assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
        assert pending == 4 and in_engine == 4
        assert wait_for(lambda: stats(srv).num_running == 0 and stats(srv).kv_usage == 0)
