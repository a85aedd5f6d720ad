"""A scripted OpenAI-compatible chat server with known delays, for timing tests and load tests.

Streams ``max_tokens`` tokens: the first after ``ttft_s``, the rest every ``itl_s`` (``k`` per
chunk). Every chunk carries ``x_sent_ns``, the server's ``perf_counter_ns`` just before writing
it (the same clock as the client's on one machine), so a client's timing error is measurable.
A word-level prefix cache reports ``cached_tokens`` and vLLM metrics; ``broken_reset`` makes
``/reset_prefix_cache`` answer 200 without emptying it.

Run: ``python -m chatfleet.bench.testserver --port 0 --ttft-ms 20 --itl-ms 10`` (prints the port).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import time
from dataclasses import dataclass


@dataclass
class ScriptConfig:
    ttft_s: float = 0.02
    itl_s: float = 0.01
    tokens_per_chunk: int = 1
    block_size: int = 16
    broken_reset: bool = False
    prefix_cache: bool = True
    max_inflight: int = 0  # > 0: answer 429 beyond this many streams
    itl_per_stream_s: float = 0.0  # added to the ITL per concurrent stream: latency grows with load
    report_cached: bool = True  # False: usage has no prompt_tokens_details (metrics still count hits)
    model: str = "scripted"


class ScriptedServer:
    def __init__(self, cfg: ScriptConfig) -> None:
        self.cfg = cfg
        self.blocks: set[bytes] = set()
        self.queries = 0
        self.hits = 0
        self.inflight = 0
        self.requests = 0
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.server = await asyncio.start_server(self._conn, host, port, backlog=4096, limit=1 << 22)
        return self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for w in list(self.writers):
                w.close()
            await self.server.wait_closed()
            self.server = None

    # -- prefix cache over words ---------------------------------------------------------
    def _cache(self, words: list[str]) -> int:
        bs = self.cfg.block_size
        parent = b""
        cached, matching = 0, True
        for i in range(0, len(words) - len(words) % bs, bs):
            parent = hashlib.blake2b(parent + "\x00".join(words[i : i + bs]).encode(), digest_size=16).digest()
            if matching and parent in self.blocks:
                cached += bs
            else:
                matching = False
                if self.cfg.prefix_cache:
                    self.blocks.add(parent)
        return cached if self.cfg.prefix_cache else 0

    # -- HTTP ----------------------------------------------------------------------------
    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {}
                for ln in lines[1:]:
                    if ln:
                        k, _, v = ln.partition(":")
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                await self._route(method, path.split("?")[0], body, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    def _send(self, writer, status: int, obj, ctype: str = "application/json") -> None:
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests"}.get(status, "OK")
        writer.write(f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: keep-alive\r\n\r\n".encode() + data)

    async def _route(self, method: str, path: str, body: bytes, writer) -> None:
        if path in ("/reset_prefix_cache", "/flush_cache") and method == "POST":
            if not self.cfg.broken_reset:
                self.blocks.clear()
            self._send(writer, 200, b"", "text/plain")
        elif path == "/metrics":
            name = f'{{model_name="{self.cfg.model}"}}'
            text = (f"vllm:prefix_cache_queries_total{name} {self.queries}\n"
                    f"vllm:prefix_cache_hits_total{name} {self.hits}\n"
                    f"vllm:num_requests_running{name} {self.inflight}\n"
                    f"vllm:kv_cache_usage_perc{name} 0.0\n")
            self._send(writer, 200, text.encode(), "text/plain; version=0.0.4")
        elif path in ("/health", "/v1/models"):
            self._send(writer, 200, {"object": "list", "data": [{"id": self.cfg.model, "object": "model"}]})
        elif path == "/v1/chat/completions" and method == "POST":
            await self._chat(body, writer)
        else:
            self._send(writer, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})

    async def _chat(self, body: bytes, writer) -> None:
        try:
            req = json.loads(body)
            words = " ".join(f"{m['role']} {m['content']}" for m in req["messages"]).split()
            n = int(req.get("max_tokens") or 16)
        except (ValueError, KeyError, TypeError) as e:
            self._send(writer, 400, {"error": {"message": f"bad request: {e}", "type": "invalid_request_error"}})
            return
        if self.cfg.max_inflight and self.inflight >= self.cfg.max_inflight:
            self._send(writer, 429, {"error": {"message": "too many streams", "type": "rate_limit_error"}})
            return
        self.requests += 1
        if not req.get("stream"):
            cached = self._cache(words)
            self.queries += len(words)
            self.hits += cached
            self._send(writer, 200, {
                "id": "chatcmpl-scripted", "object": "chat.completion", "model": self.cfg.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": " tok" * n},
                             "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(words), "completion_tokens": n, "total_tokens": len(words) + n,
                          **({"prompt_tokens_details": {"cached_tokens": cached}} if self.cfg.report_cached else {})}})
            return
        self.inflight += 1
        try:
            await self._stream(req, words, n, writer)
        finally:
            self.inflight -= 1

    async def _stream(self, req: dict, words: list[str], n: int, writer) -> None:
        cfg = self.cfg
        req_no = self.requests
        prompt = len(words)
        cached = self._cache(words)
        self.queries += prompt
        self.hits += cached
        want_usage = bool((req.get("stream_options") or {}).get("include_usage"))
        continuous = bool((req.get("stream_options") or {}).get("continuous_usage_stats"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Connection: keep-alive\r\n\r\n")
        sent = 0
        k = max(1, cfg.tokens_per_chunk)
        due = time.perf_counter() + cfg.ttft_s - cfg.itl_s
        while sent < n:
            step = min(k, n - sent)
            due += (cfg.itl_s + cfg.itl_per_stream_s * self.inflight) * step if sent else cfg.itl_s * step
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent += step
            chunk = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": cfg.model,
                     "choices": [{"index": 0, "delta": {"content": " tok" * step}, "finish_reason": None}]}
            if continuous:
                chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": sent}
            chunk["x_req"] = req_no
            chunk["x_sent_ns"] = time.perf_counter_ns()
            _write_event(writer, chunk)
            await writer.drain()
        if want_usage:
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
            if cfg.report_cached:
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            _write_event(writer, {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "choices": [],
                                  "usage": usage})
        data = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
        await writer.drain()


def _write_event(writer, obj: dict) -> None:
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--tokens-per-chunk", type=int, default=1)
    ap.add_argument("--broken-reset", action="store_true")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--max-inflight", type=int, default=0)
    ap.add_argument("--itl-per-stream-ms", type=float, default=0.0)
    ap.add_argument("--no-cached-usage", action="store_true")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop if installed")
    a = ap.parse_args(argv)
    cfg = ScriptConfig(a.ttft_ms / 1e3, a.itl_ms / 1e3, a.tokens_per_chunk, broken_reset=a.broken_reset,
                       prefix_cache=not a.no_prefix_cache, max_inflight=a.max_inflight,
                       itl_per_stream_s=a.itl_per_stream_ms / 1e3, report_cached=not a.no_cached_usage)

    async def serve() -> None:
        gc.freeze()  # long-lived state only; no GC pauses while streaming
        gc.disable()
        srv = ScriptedServer(cfg)
        port = await srv.start(a.host, a.port)
        print(f"PORT {port}", flush=True)
        await asyncio.Event().wait()

    if a.uvloop:
        try:
            import uvloop

            uvloop.run(serve())
            return
        except ImportError:
            pass
    asyncio.run(serve())


if __name__ == "__main__":
    main()
