"""Per-request output streams on the event loop: what ``AsyncEngine`` and ``EngineProcess`` share.

Each request in flight has an asyncio queue; a step's outputs are fanned out to them in one call
on the event loop (``dispatch``), an engine that stops fails them all (``fail_all``), and
``follow`` turns one queue into the request's outputs, ending with its finishing output. The
stream's ``finished`` flag tells the caller, when the consumer leaves early, whether the engine
still holds the request (then it must be aborted).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from chatfleet.engine.outputs import RequestOutput
from chatfleet.errors import ChatfleetError, InvalidRequestError

__all__ = ["OutputStream", "OutputStreams", "RequestFailedError", "observe_queue_times"]


class RequestFailedError(ChatfleetError):
    """The engine finished a request with an error."""

    status_code = 500
    error_type = "internal_error"
    code = "request_failed"


class OutputStream:
    """One request's queue; ``finished``: the engine no longer holds the request."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    async def follow(self) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs up to its finishing one; an engine failure is raised."""
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self.finished = True  # the engine no longer knows this request
                raise item
            if item.finished:
                self.finished = True
                if item.finish_reason == "error":
                    raise RequestFailedError(
                        f"request {self.request_id} failed in the engine; the server log has the cause")
            yield item
            if self.finished:
                return


class OutputStreams:
    """The open streams by request id (event loop side only)."""

    def __init__(self) -> None:
        self._streams: dict[str, OutputStream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def open(self, request_id: str) -> OutputStream:
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        stream = self._streams[request_id] = OutputStream(request_id)
        return stream

    def close(self, stream: OutputStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    def fail_all(self, err: BaseException) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(err)


def observe_queue_times(observe: Callable[[float], None], outputs: list[RequestOutput]) -> None:
    """Hand ``observe`` the queue time of each request whose first output is among ``outputs``."""
    for out in outputs:
        if out.queue_time is not None:
            observe(out.queue_time)
