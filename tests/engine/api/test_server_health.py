"""Health and errors when the engine loop dies (a fake engine whose step crashes on demand)."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.server import build_app
from chatfleet.engine.outputs import RequestOutput


class Tok:
    vocab_size = 100

    def encode(self, text):
        return [ord(c) % 100 for c in text] or [1]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(m["content"] for m in messages)


class CrashingEngine:
    model_name = "fake"
    max_model_len = 64
    tokenizer = Tok()

    def __init__(self):
        self.crash = False
        self.reqs = {}

    def add_request(self, rid, ids, params, **kw):
        self.reqs[rid] = 0

    def abort_request(self, rid):
        self.reqs.pop(rid, None)

    def has_unfinished_requests(self):
        return bool(self.reqs) or self.crash

    def step(self):
        if self.crash:
            raise RuntimeError("device lost")
        time.sleep(0.001)
        outs = []
        for rid in list(self.reqs):
            self.reqs[rid] += 1
            n = self.reqs[rid]
            outs.append(RequestOutput(rid, [n], "x", n >= 3, "length" if n >= 3 else None, 1, 0, n))
            if n >= 3:
                del self.reqs[rid]
        return outs

    def stats(self):
        return None


def test_health_turns_503_when_the_engine_loop_dies():
    fake = CrashingEngine()
    engine = AsyncEngine(fake)
    with TestClient(build_app(engine)) as client:
        assert client.get("/health").status_code == 200
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "xxx"
        engine.call_threadsafe(lambda e: setattr(e, "crash", True)).result(timeout=5)
        deadline = time.monotonic() + 5
        while engine.is_alive and time.monotonic() < deadline:
            time.sleep(0.01)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and "device lost" not in r.json()["error"]["message"]
        assert "RuntimeError" not in r.json()["error"]["message"]
        assert "chatfleet:engine_alive{model_name=\"fake\"} 0.0" in client.get("/metrics").text
