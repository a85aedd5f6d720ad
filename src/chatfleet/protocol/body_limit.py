"""A request-body limit for ASGI apps: bodies over the limit get 413 in OpenAI error JSON.

Starlette's own limit answers in plain text and stops reading mid-upload (the client then sees a
reset instead of the answer). This one reads the body off the socket (asyncio I/O: other
requests keep running), and once it is over the limit keeps draining, discarding, up to
``drain_bytes`` more so the client can read the 413; then it answers. A large body is assembled
off the GIL (``body_spool.py``); its memory file stays open while the app runs, named in the
scope (``SHARED_BODY_SCOPE_KEY``) so that a route can hand it to a worker process unpickled.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatfleet.errors import PayloadTooLargeError
from chatfleet.protocol.body_spool import SHARED_BODY_SCOPE_KEY, BodyAssembler, finished
from chatfleet.protocol.errors import error_response
from chatfleet.protocol.limits import DEFAULT_MAX_BODY_BYTES
from chatfleet.protocol.read_pacing import LARGE_BODY_BYTES, ReadPacer

DRAIN_BYTES = 64 << 20


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"


class BodyLimitMiddleware:
    """Buffer each HTTP request body up to ``max_body_bytes``; refuse larger ones with 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 drain_bytes: int = DRAIN_BYTES) -> None:
        if max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.drain_bytes = drain_bytes
        self.pacer = ReadPacer()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        body_parts = BodyAssembler()  # large bodies assembled off the GIL (body_spool.py)
        size = 0
        too_large = declared is not None and declared > self.max_body_bytes
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_parts.discard()
                return  # the client left before sending its body
            body = message.get("body", b"")
            more = message.get("more_body", False)
            size += len(body)
            if more and max(size, declared or 0) >= LARGE_BODY_BYTES:
                await self.pacer.take(len(body))  # large bodies read at a bounded rate (read_pacing.py)
            if size > self.max_body_bytes:
                too_large = True
            if too_large:
                body_parts.discard()
                if size > self.max_body_bytes + self.drain_bytes:
                    break
                continue
            body_parts.add(body)
        if too_large:
            shown = max(size, declared or 0)
            err = PayloadTooLargeError(
                f"the request body ({_mib(shown)}) is over this server's limit of"
                f" {_mib(self.max_body_bytes)} (--max-body-bytes)"
            )
            await error_response(err)(scope, receive, send)
            return
        body = await finished(body_parts)  # a spooled body read back off the event loop
        shared = body_parts.shared()  # a spooled body, for a route that hands it to a worker
        if shared is not None:
            scope[SHARED_BODY_SCOPE_KEY] = shared
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            scope.pop(SHARED_BODY_SCOPE_KEY, None)
            body_parts.close()


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that yields the buffered body once, then the client's later messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
