"""A fast fake OpenAI replica for gateway tests and the overhead benchmark.

A raw ASGI app (no framework, so it costs little next to what it measures) that answers
``/health``, ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` with canned
tokens, streamed or not. Its ``behavior`` can be changed while it runs (delays, error statuses,
a stream that breaks after k chunks, failing health checks; a request may set its own
``fake_interval_s``), and it records what it saw:
requests with their headers, streams in progress, streams whose client went away.

``python -m chatfleet.gateway.fake_replica --port 8001`` serves one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn


@dataclass
class FakeBehavior:
    tokens: int = 8  # per response, unless the request's max_tokens says otherwise
    ttft_s: float = 0.0
    interval_s: float = 0.0  # between streamed chunks
    status: int = 200
    break_after: int | None = None  # drop the connection after this many chunks
    healthy: bool = True
    step: bool = False  # wait for step() before each chunk
    stamp: bool = False  # put the send time (time.time()) in each chunk as "sent_at"
    model: str = "fake"


@dataclass
class FakeStats:
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"path", "headers", "body"}
    active: int = 0  # responses in progress
    completed: int = 0
    disconnected: int = 0  # streams whose client went away before the end


class FakeReplica:
    def __init__(self, behavior: FakeBehavior | None = None, *, record: bool = True) -> None:
        self.behavior = behavior or FakeBehavior()
        self.stats = FakeStats()
        self.record = record
        self._steps: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def step(self, n: int = 1) -> None:
        """Let ``n`` more chunks out (thread-safe) while ``behavior.step`` is on."""
        assert self._loop is not None and self._steps is not None, "no request seen yet"
        for _ in range(n):
            self._loop.call_soon_threadsafe(self._steps.release)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self._loop is None:
            self._loop, self._steps = asyncio.get_running_loop(), asyncio.Semaphore(0)
        path, b = scope["path"], self.behavior
        if path == "/health":
            return await _reply(send, 200 if b.healthy else 503, b"{}")
        if path == "/v1/models":
            return await _reply(send, 200, json.dumps({"object": "list", "data": [
                {"id": b.model, "object": "model", "owned_by": "chatfleet"}]}).encode())
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return await _reply(send, 404, b'{"error": {"message": "not found"}}')
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        body = json.loads(raw or b"{}")
        if self.record:
            self.stats.requests.append({"path": path, "headers": {
                k.decode(): v.decode() for k, v in scope["headers"]}, "body": body})
        if b.status != 200:
            return await _reply(send, b.status, json.dumps({"error": {
                "message": f"fake error {b.status}", "type": "fake", "param": None, "code": None}}).encode())
        tokens = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or b.tokens), 100_000)
        chat = path == "/v1/chat/completions"
        if b.ttft_s:
            await asyncio.sleep(b.ttft_s)
        if not body.get("stream"):
            text = "tok " * tokens
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            return await _reply(send, 200, json.dumps({
                "id": "fake-1", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": b.model, "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1},
            }).encode())
        interval = float(body.get("fake_interval_s", b.interval_s))
        await self._stream(receive, send, tokens, chat, interval)

    async def _stream(self, receive: Any, send: Any, tokens: int, chat: bool, interval: float) -> None:
        self.stats.active += 1
        producer = asyncio.ensure_future(self._produce(send, tokens, chat, interval))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((producer, gone), return_when=asyncio.FIRST_COMPLETED)
            if not producer.done():
                producer.cancel()
                self.stats.disconnected += 1
            await asyncio.gather(producer, return_exceptions=True)
            if producer.cancelled() or producer.exception() is not None:
                if producer.exception() is not None:
                    raise producer.exception()
                return
            self.stats.completed += 1
        finally:
            self.stats.active -= 1
            gone.cancel()
            producer.cancel()

    async def _produce(self, send: Any, tokens: int, chat: bool, interval: float) -> None:
        b = self.behavior
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = f'data: {{"id":"fake-1","object":"{kind}","created":0,"model":"{b.model}","choices":[{{"index":0,'
        part = '"delta":{"content":"tok "}' if chat else '"text":"tok "'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(tokens):
            if b.step:
                await self._steps.acquire()
            elif i and interval:
                await asyncio.sleep(interval)
            if b.break_after is not None and i >= b.break_after:
                raise ConnectionAbortedError("fake replica broke the stream")
            reason = '"length"' if i == tokens - 1 else "null"
            stamp = f',"sent_at":{time.time():.6f}' if b.stamp else ""
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"{head}{part},\"finish_reason\":{reason}}}]{stamp}}}\n\n".encode()})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--ttft", type=float, default=0.0)
    parser.add_argument("--interval", type=float, default=0.0)
    parser.add_argument("--stamp", action="store_true", help="send times in chunks as sent_at")
    args = parser.parse_args()
    app = FakeReplica(FakeBehavior(tokens=args.tokens, ttft_s=args.ttft, interval_s=args.interval,
                                   stamp=args.stamp), record=False)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                backlog=8192)


if __name__ == "__main__":
    main()
