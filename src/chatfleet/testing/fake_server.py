"""The one fake OpenAI server: canned replies with known delays, injected failures, a toy cache.

A raw ASGI app (no framework, so it costs little next to what it measures) answering
``/health``, ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/metrics`` and
``/reset_prefix_cache`` (or SGLang's ``/flush_cache``). Used in-process by the gateway tests
(``ServerThread(FakeServer(...))``) and as its own process by the bench's timing tests and the
benchmarks (``python -m chatfleet.testing.fake_server --port 0 --ttft-ms 20 --itl-ms 10`` prints
``PORT N``), so that its timers and a client's do not share one event loop.

Timing: a stream sends ``max_tokens`` tokens (``tokens_per_chunk`` per chunk), the first after
``ttft_s``, the rest every ``interval_s`` (plus ``itl_per_stream_s`` per stream in flight).
Every chunk carries ``x_req`` (the request's number) and ``x_sent_ns``, the server's
``perf_counter_ns`` just before writing it (the same clock as a client's on one machine), so a
client's timing error is measurable.

Failures (``behavior`` may change while it runs): an error status, a stream that breaks after k
chunks, failing health checks, 429 beyond ``max_inflight`` streams, chunks held until
``step()``; a request may set its own ``fake_interval_s``.

Cache: a word-level prefix cache in blocks reports ``cached_tokens`` and vLLM's prefix-cache
counters; ``broken_reset`` answers the reset with 200 without emptying it.

It records what it saw: requests with their headers, streams in progress, streams whose client
went away.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from chatfleet.protocol.sse import DONE


@dataclass
class FakeBehavior:
    tokens: int = 8  # per response, unless the request's max_tokens says otherwise
    ttft_s: float = 0.0
    interval_s: float = 0.0  # between streamed chunks
    tokens_per_chunk: int = 1
    itl_per_stream_s: float = 0.0  # added to the interval per stream in flight: latency grows with load
    status: int = 200
    break_after: int | None = None  # drop the connection after this many chunks
    healthy: bool = True
    step: bool = False  # wait for step() before each chunk
    max_inflight: int = 0  # > 0: answer 429 beyond this many streams
    prefix_cache: bool = True
    block_size: int = 16  # words per cache block
    broken_reset: bool = False  # the reset answers 200 and keeps the cache
    report_cached: bool = True  # False: usage has no prompt_tokens_details (metrics still count hits)
    model: str = "fake"


@dataclass
class FakeStats:
    requests: list[dict[str, Any]] = field(default_factory=list)  # {"path", "headers", "body"}
    active: int = 0  # responses in progress
    completed: int = 0
    disconnected: int = 0  # streams whose client went away before the end
    served: int = 0  # completion requests answered 200 (numbers the chunks' x_req)
    cache_queries: int = 0  # prompt words looked up
    cache_hits: int = 0


class FakeServer:
    def __init__(self, behavior: FakeBehavior | None = None, *, record: bool = True) -> None:
        self.behavior = behavior or FakeBehavior()
        self.stats = FakeStats()
        self.record = record
        self.blocks: set[bytes] = set()
        self._steps: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def step(self, n: int = 1) -> None:
        """Let ``n`` more chunks out (thread-safe) while ``behavior.step`` is on."""
        assert self._loop is not None and self._steps is not None, "no request seen yet"
        for _ in range(n):
            self._loop.call_soon_threadsafe(self._steps.release)

    # -- prefix cache over words -----------------------------------------------------------
    def _cached_words(self, words: list[str]) -> int:
        b = self.behavior
        parent, cached, matching = b"", 0, True
        for i in range(0, len(words) - len(words) % b.block_size, b.block_size):
            parent = hashlib.blake2b(parent + "\x00".join(words[i:i + b.block_size]).encode(),
                                     digest_size=16).digest()
            if matching and parent in self.blocks:
                cached += b.block_size
            else:
                matching = False
                if b.prefix_cache:
                    self.blocks.add(parent)
        cached = cached if b.prefix_cache else 0
        self.stats.cache_queries += len(words)
        self.stats.cache_hits += cached
        return cached

    def _usage(self, words: list[str], completion: int) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": len(words), "completion_tokens": completion,
                                 "total_tokens": len(words) + completion}
        cached = self._cached_words(words)
        if self.behavior.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    # -- ASGI --------------------------------------------------------------------------------
    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self._loop is None:
            self._loop, self._steps = asyncio.get_running_loop(), asyncio.Semaphore(0)
        path, method, b = scope["path"], scope["method"], self.behavior
        if path == "/health":
            return await _reply(send, 200 if b.healthy else 503, b"{}")
        if path == "/v1/models":
            return await _reply(send, 200, json.dumps({"object": "list", "data": [
                {"id": b.model, "object": "model", "owned_by": "chatfleet"}]}).encode())
        if path == "/metrics":
            name, s = f'{{model_name="{b.model}"}}', self.stats
            text = (f"vllm:prefix_cache_queries_total{name} {s.cache_queries}\n"
                    f"vllm:prefix_cache_hits_total{name} {s.cache_hits}\n"
                    f"vllm:num_requests_running{name} {s.active}\n"
                    f"vllm:kv_cache_usage_perc{name} 0.0\n")
            return await _reply(send, 200, text.encode(), b"text/plain; version=0.0.4")
        if path in ("/reset_prefix_cache", "/flush_cache") and method == "POST":
            if not b.broken_reset:
                self.blocks.clear()
            return await _reply(send, 200, b"", b"text/plain")
        if path not in ("/v1/chat/completions", "/v1/completions") or method != "POST":
            return await _reply(send, 404, json.dumps({"error": {
                "message": f"no route {method} {path}", "type": "not_found"}}).encode())
        arrived = time.perf_counter()  # the TTFT clock starts here, not after parsing
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            body = json.loads(raw or b"{}")
            words = _prompt_words(body, chat=path == "/v1/chat/completions")
            tokens = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or b.tokens), 100_000)
            interval = float(body.get("fake_interval_s", b.interval_s))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            return await _reply(send, 400, json.dumps({"error": {
                "message": f"bad request: {e}", "type": "invalid_request_error"}}).encode())
        if self.record:
            self.stats.requests.append({"path": path, "headers": {
                k.decode(): v.decode() for k, v in scope["headers"]}, "body": body})
        if b.status != 200:
            return await _reply(send, b.status, json.dumps({"error": {
                "message": f"fake error {b.status}", "type": "fake", "param": None, "code": None}}).encode())
        if b.max_inflight and self.stats.active >= b.max_inflight:
            return await _reply(send, 429, json.dumps({"error": {
                "message": "too many streams", "type": "rate_limit_error"}}).encode())
        self.stats.served += 1
        chat = path == "/v1/chat/completions"
        if not body.get("stream"):
            if b.ttft_s:
                await asyncio.sleep(max(0.0, arrived + b.ttft_s - time.perf_counter()))
            text = "tok " * tokens
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat else
                      {"index": 0, "text": text, "finish_reason": "length"})
            return await _reply(send, 200, json.dumps({
                "id": "fake-1", "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": b.model, "choices": [choice],
                "usage": self._usage(words, tokens)}).encode())
        stream = _Stream(self.stats.served, chat, tokens, interval, words, body.get("stream_options") or {}, arrived)
        await self._stream(receive, send, stream)

    async def _stream(self, receive: Any, send: Any, stream: _Stream) -> None:
        self.stats.active += 1
        producer = asyncio.ensure_future(self._produce(send, stream))
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((producer, gone), return_when=asyncio.FIRST_COMPLETED)
            if not producer.done():
                producer.cancel()
                self.stats.disconnected += 1
            await asyncio.gather(producer, return_exceptions=True)
            if producer.cancelled():
                return
            failure = producer.exception()
            if failure is not None:
                raise failure
            self.stats.completed += 1
        finally:
            self.stats.active -= 1
            gone.cancel()
            producer.cancel()

    async def _produce(self, send: Any, s: _Stream) -> None:
        b = self.behavior
        kind = "chat.completion.chunk" if s.chat else "text_completion"
        head = f'data: {{"id":"fake-1","object":"{kind}","created":0,"model":"{b.model}","choices":[{{"index":0,'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        usage = self._usage(s.words, s.tokens)
        per_chunk = max(1, b.tokens_per_chunk)
        due = s.arrived + b.ttft_s
        sent = 0
        while sent < s.tokens:
            n = min(per_chunk, s.tokens - sent)
            if b.step:
                assert self._steps is not None, "set on the first request"
                await self._steps.acquire()
            else:
                if sent:
                    due += (s.interval + b.itl_per_stream_s * self.stats.active) * n
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            if b.break_after is not None and sent >= b.break_after:
                raise ConnectionAbortedError("fake server broke the stream")
            sent += n
            part = '"delta":{"content":"%s"}' % ("tok " * n) if s.chat else '"text":"%s"' % ("tok " * n)
            reason = '"length"' if sent == s.tokens else "null"
            extra = f',"usage":{{"prompt_tokens":{len(s.words)},"completion_tokens":{sent}}}' if s.continuous else ""
            await send({"type": "http.response.body", "more_body": True, "body": (
                f'{head}{part},"finish_reason":{reason}}}]{extra},"x_req":{s.number},'
                f'"x_sent_ns":{time.perf_counter_ns()}}}\n\n').encode()})
        tail = DONE
        if s.include_usage:
            tail = (f'data: {{"id":"fake-1","object":"{kind}","created":0,"model":"{b.model}","choices":[],'
                    f'"usage":{json.dumps(usage)}}}\n\n').encode() + DONE
        await send({"type": "http.response.body", "body": tail, "more_body": False})


@dataclass(frozen=True)
class _Stream:
    number: int
    chat: bool
    tokens: int
    interval: float
    words: list[str]
    options: dict[str, Any]
    arrived: float  # perf_counter() when the request arrived

    @property
    def include_usage(self) -> bool:
        return bool(self.options.get("include_usage"))

    @property
    def continuous(self) -> bool:
        return bool(self.options.get("continuous_usage_stats"))


def _prompt_words(body: dict[str, Any], chat: bool) -> list[str]:
    if chat:
        return " ".join(f"{m['role']} {m.get('content') or ''}" for m in body["messages"]).split()
    prompt = body.get("prompt", "")
    return [str(t) for t in prompt] if isinstance(prompt, list) else str(prompt).split()


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _reply(send: Any, status: int, body: bytes, content_type: bytes = b"application/json") -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0: any free port (printed as PORT N)")
    ap.add_argument("--tokens", type=int, default=8, help="reply tokens when the request sets no max_tokens")
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--itl-per-stream-ms", type=float, default=0.0)
    ap.add_argument("--max-inflight", type=int, default=0)
    ap.add_argument("--broken-reset", action="store_true")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--no-cached-usage", action="store_true")
    ap.add_argument("--model", default="fake")
    a = ap.parse_args(argv)
    app = FakeServer(FakeBehavior(
        tokens=a.tokens, ttft_s=a.ttft_ms / 1e3, interval_s=a.itl_ms / 1e3, tokens_per_chunk=a.tokens_per_chunk,
        itl_per_stream_s=a.itl_per_stream_ms / 1e3, max_inflight=a.max_inflight, broken_reset=a.broken_reset,
        prefix_cache=not a.no_prefix_cache, report_cached=not a.no_cached_usage, model=a.model), record=False)
    gc.freeze()  # long-lived state only: fewer GC pauses while streaming
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY on accept
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    # In the main thread, so the process's own CPU counters (/proc/PID/schedstat) see the server.
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                  backlog=8192)).run(sockets=[sock])

if __name__ == "__main__":
    main()
