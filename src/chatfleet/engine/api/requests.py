"""One HTTP request's life in the engine server: its deadline, its outputs, its SSE response.

``ServerState.start`` submits a request and waits for its first output (so admission errors
are HTTP errors); ``RequestOutputs`` iterates the rest under the request's ``Deadline`` and
aborts the request, freeing its KV blocks, when closed early, cancelled or out of time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from contextlib import suppress
from typing import TypeVar

from fastapi import Request
from starlette.responses import Response, StreamingResponse

from chatfleet.engine.api.engine_client import EngineClient
from chatfleet.engine.api.memory_metrics import MemoryCollector
from chatfleet.engine.api.metrics import RequestTimer, ServerMetrics
from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.errors import ChatfleetError, ModelNotFoundError, RequestTimeoutError
from chatfleet.protocol.sse import MEDIA_TYPE

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Deadline:
    """A request's deadline on the event loop's clock; ``None`` timeout: no deadline."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    async def run(self, aw: Awaitable[T]) -> T:
        """Await ``aw``; past the deadline it is cancelled and ``RequestTimeoutError`` raised."""
        if self.at is None:
            return await aw
        try:
            async with asyncio.timeout_at(self.at):
                return await aw
        except TimeoutError:
            raise RequestTimeoutError(
                f"the request ran past this server's {self.timeout_s:g} s deadline"
                " (--request-timeout) and was stopped"
            ) from None


class ServerState:
    """What the routes share: the engine, metrics and the names this server answers to."""

    def __init__(self, engine: EngineClient, model_aliases: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.names = {engine.model_name, *model_aliases}
        self.metrics = ServerMetrics(engine.model_name)
        if engine.memory is not None:  # the start-up memory breakdown, as gauges
            self.metrics.registry.register(MemoryCollector(engine.model_name, engine.memory))
        engine.on_first_scheduled = self.metrics.queue_time.observe
        self.open_requests = 0

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            raise ModelNotFoundError(
                f"the model {model!r} does not exist on this server; it serves {self.model_name!r}",
                param="model",
            )

    async def start(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None,
        session_id: str | None = None, deadline: Deadline | None = None,
    ) -> RequestOutputs:
        """Submit a request and wait for its first output, so that admission errors are HTTP errors."""
        deadline = deadline or Deadline(None)
        timer = RequestTimer(self.metrics)
        gen = self.engine.generate(request_id, prompt_ids, params, cache_salt=cache_salt, session_id=session_id)
        try:
            first = await deadline.run(anext(gen))
        except ChatfleetError as exc:
            self.metrics.request_rejected(exc.status_code)
            await gen.aclose()
            raise
        return RequestOutputs(self, first, gen, timer, deadline)


class RequestOutputs:
    """One request's outputs as an async iterator; ``aclose()`` (idempotent) aborts it if unfinished."""

    def __init__(self, state: ServerState, first: RequestOutput, gen: AsyncGenerator[RequestOutput, None],
                 timer: RequestTimer, deadline: Deadline) -> None:
        self._state = state
        self._first: RequestOutput | None = first
        self._gen = gen
        self._timer = timer
        self._deadline = deadline
        self._closed = False
        state.open_requests += 1

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
        else:
            out = await self._deadline.run(anext(self._gen))
        self._timer.on_output(out)
        return out

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._state.open_requests -= 1
            self._timer.on_abort()  # a no-op when its last output came
            await self._gen.aclose()


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body and request (aborting it if unfinished)."""

    media_type = MEDIA_TYPE

    def __init__(self, content: AsyncGenerator[bytes, None], outputs: RequestOutputs | list[RequestOutputs]) -> None:
        super().__init__(content, headers=SSE_HEADERS)
        self._content = content  # Starlette's body_iterator, typed as the generator it is
        self.outputs = outputs if isinstance(outputs, list) else [outputs]

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()
            for outputs in self.outputs:
                await outputs.aclose()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(request: Request, handler: Awaitable[Response]) -> Response:
    """Run ``handler``; if the client goes away first, cancel it (aborting its request)."""
    task = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        with suppress(asyncio.CancelledError):
            await listener
    if task.cancelled() or not task.done():
        with suppress(asyncio.CancelledError, Exception):
            await task
        return Response(status_code=499)
    return task.result()
