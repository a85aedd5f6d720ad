"""Server-sent events: framing for the servers, the one parser for clients and proxies.

OpenAI streams are ``data: {json}\\n\\n`` events ended by ``data: [DONE]\\n\\n``.

- ``encode_event``: one event, for servers.
- ``SSEParser`` / ``iter_sse`` / ``aiter_sse``: the full parser (fields, comments, any line ending).
- ``DataSplitter``: the load generator's hot path, raw bytes in, ``data`` payloads out, no
  per-line decoding (same results as the parser on the events servers send).
- ``EventFramer``: a proxy's pass-through, bytes up to the last complete event.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

DONE_DATA = "[DONE]"
DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"


def encode_event(data: BaseModel | dict | list | str | bytes, *, event: str | None = None) -> bytes:
    """One SSE event. Models and dicts become compact JSON; str/bytes are sent as they are."""
    if isinstance(data, BaseModel):
        payload = data.model_dump_json()
    elif isinstance(data, (dict, list)):
        payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    elif isinstance(data, bytes):
        payload = data.decode("utf-8")
    else:
        payload = data
    lines = [f"event: {event}"] if event else []
    lines += [f"data: {line}" for line in payload.split("\n")]
    return ("\n".join(lines) + "\n\n").encode("utf-8")


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str | None = None
    id: str | None = None

    @property
    def is_done(self) -> bool:
        return self.data.strip() == DONE_DATA

    def json(self) -> Any:
        """The data parsed as JSON (raises ValueError on bad JSON or on ``[DONE]``)."""
        return json.loads(self.data)

    def encode(self) -> bytes:
        """Re-frame this event (for proxies passing events through)."""
        return encode_event(self.data, event=self.event)


class SSEParser:
    """Incremental SSE parser: ``feed(bytes) -> list[SSEEvent]``; chunk boundaries may fall anywhere.

    Handles LF, CRLF and CR line endings, multi-line data, comments (``:`` lines) and
    events without data (dropped, as the spec says).
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._buf += chunk
        events: list[SSEEvent] = []
        while True:
            line, found = self._next_line()
            if not found:
                break
            ev = self._line(line)
            if ev is not None:
                events.append(ev)
        return events

    def flush(self) -> list[SSEEvent]:
        """At end of stream: a final event not followed by a blank line is still delivered."""
        events: list[SSEEvent] = []
        if self._buf:
            ev = self._line(self._buf.decode("utf-8", errors="replace").rstrip("\r"))
            self._buf = b""
            if ev is not None:
                events.append(ev)
        ev = self._dispatch()
        if ev is not None:
            events.append(ev)
        return events

    def _next_line(self) -> tuple[str, bool]:
        hits = [i for i in (self._buf.find(b"\n"), self._buf.find(b"\r")) if i >= 0]
        if not hits:
            return "", False
        i = min(hits)
        end = i + 1
        if self._buf[i] == 0x0D:
            if i + 1 == len(self._buf):
                return "", False  # CR at the end: wait to see whether LF follows
            if self._buf[i + 1] == 0x0A:
                end = i + 2
        line = self._buf[:i].decode("utf-8", errors="replace")
        self._buf = self._buf[end:]
        return line, True

    def _line(self, line: str) -> SSEEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id":
            self._id = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        if not self._data:
            self._event = None
            return None
        ev = SSEEvent(data="\n".join(self._data), event=self._event, id=self._id)
        self._data, self._event = [], None
        return ev


def iter_sse(chunks: Iterable[bytes]) -> Iterator[SSEEvent]:
    parser = SSEParser()
    for chunk in chunks:
        yield from parser.feed(chunk)
    yield from parser.flush()


async def aiter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[SSEEvent]:
    """Events from an async byte stream, e.g. ``httpx.Response.aiter_bytes()``."""
    parser = SSEParser()
    async for chunk in chunks:
        for ev in parser.feed(chunk):
            yield ev
    for ev in parser.flush():
        yield ev


class DataSplitter:
    """Fast path: ``feed(bytes) -> list[bytes]``, the ``data`` payload of each complete event.

    Events without data (comments, keep-alives) give nothing; multi-line data is joined with
    ``\\n``; CRLF framing is accepted (a CR split from its LF waits in the tail).
    """

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self.buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = buf.split(b"\n\n")
        self.buf = events.pop()  # the unfinished tail
        out = []
        for event in events:
            if event.startswith(b"data:") and b"\n" not in event:
                out.append(event[5:].strip())
                continue
            lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
        return out


class EventFramer:
    """Pass-through for proxies: ``push(bytes)`` returns the bytes up to the last complete event
    and keeps a partial event back (``tail``), so a client never sees half an event."""

    def __init__(self) -> None:
        self.tail = b""

    def push(self, chunk: bytes) -> bytes:
        if not self.tail and chunk.endswith(b"\n\n"):
            return chunk
        data = self.tail + chunk
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n")
        cut = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        self.tail = data[cut:]
        return data[:cut]
