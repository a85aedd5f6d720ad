"""Streaming chat client that times every token from the intended send time.

TTFT is taken at the first content token; inter-token latency per token (a chunk carrying
several tokens has its gap split evenly among them); reply latency at the last token. All are
measured from when the request *should* have gone out, so a slow server or a lagging client
cannot hide delay (coordinated omission); the client-side wait is reported as ``queue_s``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from chatfleet.bench.records import RequestRecord
from chatfleet.bench.transport import Session
from chatfleet.protocol.sse import DataSplitter

SESSION_HEADER = "X-Session-ID"  # one id per conversation, as the gateway forwards it


@dataclass(frozen=True)
class ClientConfig:
    model: str
    temperature: float = 1.0
    request_timeout_s: float = 300.0
    force_length: bool = True  # min_tokens = max_tokens
    continuous_usage: bool = False  # ask for per-chunk usage (vLLM) to count tokens per chunk
    extra_body: dict = field(default_factory=dict)
    send_session_id: bool = True  # X-Session-ID per conversation (session-aware engines and gateways)
    on_chunk: Callable[[int, dict], None] | None = None  # (arrival ns, event) probe for timing checks


@dataclass
class ChatResult:
    record: RequestRecord
    text: str  # the reply, for the next turn's history


def build_payload(cfg: ClientConfig, messages: list[dict], max_tokens: int) -> dict:
    stream_options = {"include_usage": True}
    if cfg.continuous_usage:
        stream_options["continuous_usage_stats"] = True
    body = {
        "model": cfg.model,
        "messages": messages,
        "stream": True,
        "stream_options": stream_options,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
    }
    if cfg.force_length:
        body["min_tokens"] = max_tokens
    body.update(cfg.extra_body)
    return body


async def send_chat(session: Session, cfg: ClientConfig, rec: RequestRecord, messages: list[dict],
                    t0_ns: int, intended_ns: int) -> ChatResult:
    """Send one streaming chat request and fill ``rec``; never raises for server trouble."""
    body = json.dumps(build_payload(cfg, messages, rec.expected_tokens), ensure_ascii=False).encode()
    sec = 1e-9
    rec.intended_s = (intended_ns - t0_ns) * sec
    pieces: list[str] = []
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            sent_ns = time.perf_counter_ns()
            rec.sent_s = (sent_ns - t0_ns) * sec
            rec.queue_s = max(0, sent_ns - intended_ns) * sec
            headers = {SESSION_HEADER: rec.session_id} if cfg.send_session_id and rec.session_id else {}
            resp = await session.post("/v1/chat/completions", body, headers)
            rec.http_status = resp.status
            if resp.status != 200:
                raw = b"".join([c async for _, c in resp.chunks])
                rec.status = "rate_limited" if resp.status == 429 else "error"
                rec.error = _error_message(resp.status, raw)
                return ChatResult(rec, "")
            await _consume(resp.chunks, rec, pieces, t0_ns, intended_ns, cfg.on_chunk)
    except TimeoutError:
        await session.discard()
        rec.status, rec.error = "timeout", f"no complete reply within {cfg.request_timeout_s:g}s"
    except (OSError, ConnectionError, ValueError, asyncio.IncompleteReadError) as e:
        await session.discard()
        rec.status, rec.error = "error", f"{type(e).__name__}: {e}"
    if rec.status == "ok" and rec.first_token_s is None:
        rec.status, rec.error = "error", rec.error or "stream ended without a content token"
    return ChatResult(rec, "".join(pieces))


async def _consume(chunks, rec: RequestRecord, pieces: list[str], t0_ns: int, intended_ns: int, probe) -> None:
    sse = DataSplitter()
    sec = 1e-9
    first_ns = last_ns = None
    counted = 0
    usage_seen = 0  # cumulative completion tokens from continuous usage
    async for recv_ns, data in chunks:
        for payload in sse.feed(data):
            if payload == b"[DONE]":
                continue
            obj = json.loads(payload)
            if probe is not None:
                probe(recv_ns, obj)
            if "error" in obj and not obj.get("choices"):
                err = obj["error"]
                rec.status = "error"
                rec.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                continue
            usage = obj.get("usage")
            n_tokens = 0
            text = ""
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") or {}
                text += delta.get("content") or ""
                lp = (choice.get("logprobs") or {}).get("content")
                if lp:
                    n_tokens = len(lp)
            if usage and obj.get("choices") and usage.get("completion_tokens") is not None:
                n_tokens = usage["completion_tokens"] - usage_seen
                usage_seen = usage["completion_tokens"]
            if text or n_tokens > 0:
                n_tokens = n_tokens if n_tokens > 0 else 1
                pieces.append(text)
                if first_ns is None:
                    first_ns = recv_ns
                    rec.first_token_s = (recv_ns - t0_ns) * sec
                    rec.ttft_s = (recv_ns - intended_ns) * sec
                else:
                    gap = (recv_ns - last_ns) * sec / n_tokens
                    rec.itl_s.extend([gap] * n_tokens)
                last_ns = recv_ns
                counted += n_tokens
            if usage and not obj.get("choices"):
                rec.prompt_tokens = usage.get("prompt_tokens")
                details = usage.get("prompt_tokens_details") or {}
                rec.cached_tokens = details.get("cached_tokens")
                if usage.get("completion_tokens") is not None:
                    counted = usage["completion_tokens"]
    if last_ns is not None:
        rec.end_s = (last_ns - t0_ns) * sec
        rec.reply_s = (last_ns - intended_ns) * sec
    rec.output_tokens = counted


def _error_message(status: int, raw: bytes) -> str:
    try:
        obj = json.loads(raw)
        err = obj.get("error", obj)
        msg = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, AttributeError):
        msg = raw[:300].decode("utf-8", "replace")
    return f"HTTP {status}: {msg}"
