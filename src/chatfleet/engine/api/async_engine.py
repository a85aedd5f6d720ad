"""AsyncEngine: runs ``Engine.step()`` on a dedicated thread and streams outputs to asyncio.

Only the engine thread touches the Engine. Callers post commands (add, abort, any call) to a
thread-safe inbox that the thread drains before each step; when there is nothing to do it
sleeps on a condition. Outputs of a step are handed to the event loop in one
``call_soon_threadsafe`` and fanned out to per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from chatfleet.engine.api.output_streams import OutputStreams, observe_queue_times
from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.errors import ChatfleetError, EngineDeadError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None
    cache_salt: str | None
    session_id: str | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncEngine:
    """asyncio front of an ``Engine``; one instance per server process."""

    def __init__(self, engine: Any, *, check_integrity_when_idle: bool = False) -> None:
        self.engine = engine
        self.check_integrity_when_idle = check_integrity_when_idle
        self._cond = threading.Condition()
        self._inbox: list[_Add | _Abort | _Call] = []
        self._stop = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams = OutputStreams()
        self.dead_error: BaseException | None = None
        # queue-time observer, called on the engine thread once per request with first_scheduled -
        # arrival (s), when its first output arrives (``RequestOutput.queue_time``)
        self.on_first_scheduled: Callable[[float], None] | None = None

    # ------------------------------------------------------------ engine facts

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def grammar_compiler(self) -> Any:
        """The engine's grammar compiler (structured output), or None where it has none."""
        structured = getattr(self.engine, "structured", None)
        return None if structured is None else structured.compiler

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def memory(self) -> Any:
        """The engine's start-up memory breakdown (``engine/sizing/memory.py``'s ``MemoryBreakdown``), or None."""
        return getattr(self.engine, "memory", None)

    @property
    def kv_cache_tokens(self) -> int | None:
        """Tokens the device KV pool holds."""
        kv = getattr(self.engine, "kv", None)
        return getattr(kv, "total_tokens", None)

    @property
    def max_request_tokens(self) -> int:
        """Most prompt + max_tokens one request may hold (context length and KV pool bound)."""
        return getattr(self.engine, "max_request_tokens", self.engine.max_model_len)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered on ``loop`` (default: the running one)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="chatfleet-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ------------------------------------------------------------ public API

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs; the request is aborted if the consumer stops early.

        Raises the engine's add_request errors (400/503) before the first output.
        """
        self._check_alive()
        stream = self._streams.open(request_id)
        cmd = _Add(request_id, list(prompt_token_ids), params, arrival_time, cache_salt, session_id)
        try:
            self._post(cmd)
            await asyncio.wrap_future(cmd.future)
            async for out in stream.follow():
                yield out
        finally:
            self._streams.close(stream)
            if not stream.finished and self.dead_error is None:
                self._post(_Abort(request_id))

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished); its blocks free within one step."""
        self._post(_Abort(request_id))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.call_threadsafe(fn))

    def call_threadsafe(self, fn: Callable[[Any], T]) -> concurrent.futures.Future:
        """Like ``call`` but usable from any thread; returns a concurrent Future."""
        self._check_alive()
        cmd = _Call(fn)
        self._post(cmd)
        return cmd.future

    async def stats(self) -> Any:
        return await self.call(lambda e: e.stats())

    async def reset_prefix_cache(self) -> bool:
        return await self.call(lambda e: e.reset_prefix_cache())

    # ------------------------------------------------------------ engine thread

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError("the engine loop stopped after an internal error; the server log has the cause")
        if self._thread is None:
            raise EngineDeadError("the engine is not started")

    def _post(self, cmd: _Add | _Abort | _Call) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    def _run(self) -> None:
        engine = self.engine
        checked_idle = True
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stop or engine.has_unfinished_requests()):
                        if self.check_integrity_when_idle and not checked_idle:
                            break
                        self._cond.wait()
                    if self._stop:
                        break
                    inbox, self._inbox = self._inbox, []
                for cmd in inbox:
                    self._apply(cmd)
                if engine.has_unfinished_requests():
                    checked_idle = False
                    outputs = engine.step()
                    if self.on_first_scheduled is not None:
                        observe_queue_times(self.on_first_scheduled, outputs)
                    if outputs:
                        assert self._loop is not None  # set by start(), before the thread
                        self._loop.call_soon_threadsafe(self._streams.dispatch, outputs)
                elif self.check_integrity_when_idle and not checked_idle:
                    engine.check_integrity()
                    checked_idle = True
        except BaseException as exc:  # noqa: BLE001 - the loop must report any crash
            log.exception("engine loop crashed")
            self.dead_error = exc
            err = EngineDeadError("the engine loop stopped after an internal error; the server log has the cause")
            self._fail_inbox(err)
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._streams.fail_all, err)
        else:
            self._fail_inbox(EngineDeadError("the engine is shutting down"))

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)
            return
        if not cmd.future.set_running_or_notify_cancel():
            return  # the caller gave up before the command ran
        try:
            if isinstance(cmd, _Add):
                self.engine.add_request(
                    cmd.request_id, cmd.prompt_token_ids, cmd.params,
                    arrival_time=cmd.arrival_time, cache_salt=cmd.cache_salt,
                    session_id=cmd.session_id,
                )
                result = None
            else:
                result = cmd.fn(self.engine)
        except ChatfleetError as exc:
            cmd.future.set_exception(exc)
        except Exception as exc:  # noqa: BLE001 - a foreign error fails this command only
            log.exception("engine command failed")
            cmd.future.set_exception(exc)
        else:
            cmd.future.set_result(result)

    def _fail_inbox(self, err: BaseException) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for cmd in inbox:
            if not isinstance(cmd, _Abort) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(err)
