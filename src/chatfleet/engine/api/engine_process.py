"""EngineProcess: the engine core in a spawned process, an ``EngineClient`` to the HTTP front.

The API process keeps the HTTP work (parsing, chat templates and tokenizing, SSE framing, the
JSON of every streamed token) and its own tokenizer and grammar compiler (for the 400s before a
request is queued); the core process (``core_process.run_core``) runs the scheduler, the model
and the detokenizer, and sends each step's outputs back in one message. On two cores with one
torch thread, the step loop no longer waits for the GIL behind the event loop, nor the event loop
behind it.

Lifecycle: the constructor spawns the core and waits until it has loaded the model (a refusal,
such as a KV pool that does not fit, is raised as the ChatfleetError the core raised; a core that
dies while loading, as EngineDeadError). ``start`` starts the reader thread that hands outputs to
the event loop; ``shutdown`` stops the core and waits for it. If the core dies, every open stream
and pending call fails with EngineDeadError and ``is_alive`` turns false (``/health`` says 503).
If the API process dies, the core sees its pipe close and exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
from collections.abc import AsyncGenerator, Callable

from chatfleet.engine.api.core_messages import (
    AbortRequest,
    AddRequest,
    CoreFacts,
    LoadFailed,
    Outputs,
    Query,
    QueryKind,
    Ready,
    Reply,
    Stop,
)
from chatfleet.engine.api.core_process import run_core
from chatfleet.engine.api.output_streams import OutputStreams, observe_queue_times
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import EngineConfig
from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.sizing.memory import MemoryBreakdown
from chatfleet.engine.stats import EngineStats
from chatfleet.engine.structured.compiler import GrammarCompiler
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.errors import EngineDeadError

log = logging.getLogger(__name__)

__all__ = ["EngineProcess"]

LOAD_POLL_S = 0.25


class EngineProcess:
    """The engine core in a process of its own; one instance per server process."""

    def __init__(self, config: EngineConfig, *, log_level: str | None = None,
                 check_integrity_when_idle: bool = False) -> None:
        folder = resolve_model(config.model)  # a built-in model is built here once, before the core loads it
        self._tokenizer = ChatTokenizer.from_pretrained(folder)
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold OpenMP threads
        core_commands, self._commands = ctx.Pipe(duplex=False)
        self._events, core_events = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=run_core, name="chatfleet-engine-core", daemon=True,
                                    args=(config, core_commands, core_events, log_level, check_integrity_when_idle))
        self._process.start()
        core_commands.close()
        core_events.close()
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future[object]] = {}
        self._calls_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._streams = OutputStreams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None
        self.on_first_scheduled: Callable[[float], None] | None = None
        self.facts = self._wait_until_loaded()
        self._grammar_compiler = (GrammarCompiler(self._tokenizer.backend.to_str(), self.facts.vocab_size,
                                                  self._tokenizer.eos_token_id) if self.facts.grammars else None)

    def _wait_until_loaded(self) -> CoreFacts:
        msg: object = None
        while msg is None:
            if self._events.poll(LOAD_POLL_S):
                try:
                    msg = self._events.recv()
                except (EOFError, OSError):  # the core exited before saying anything
                    break
            elif not self._process.is_alive():
                break
        if isinstance(msg, Ready):
            return msg.facts
        self._process.join(5)
        self._close_pipes()
        if isinstance(msg, LoadFailed):
            raise msg.error
        assert msg is None, msg
        raise EngineDeadError(f"the engine core process exited while loading (exit code "
                              f"{self._process.exitcode}); its log above has the cause")

    # ------------------------------------------------------------ engine facts

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.facts.model_name

    @property
    def grammar_compiler(self) -> GrammarCompiler | None:
        return self._grammar_compiler

    @property
    def max_model_len(self) -> int:
        return self.facts.max_model_len

    @property
    def memory(self) -> MemoryBreakdown | None:
        return self.facts.memory

    @property
    def kv_cache_tokens(self) -> int | None:
        return self.facts.kv_cache_tokens

    @property
    def max_request_tokens(self) -> int:
        return self.facts.max_request_tokens

    @property
    def core_pid(self) -> int:
        return self.facts.pid

    @property
    def is_alive(self) -> bool:
        return (self._reader is not None and self._reader.is_alive() and self.dead_error is None
                and self._process.is_alive())

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------ lifecycle

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start handing the core's outputs to ``loop`` (default: the running one)."""
        if self._reader is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._reader = threading.Thread(target=self._read, name="chatfleet-core-reader", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the core and wait for it (terminated after ``timeout``)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._send(Stop())
        except (OSError, ValueError):
            pass  # already gone
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine core did not stop within %.0f s; terminating it", timeout)
            self._process.terminate()
            self._process.join(timeout)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout)
        self._fail_calls(EngineDeadError("the engine is shutting down"))
        self._close_pipes()
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()

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
        try:
            added = self._call(lambda call_id: AddRequest(call_id, request_id, list(prompt_token_ids), params,
                                                          arrival_time, cache_salt, session_id))
            await asyncio.wrap_future(added)
            async for out in stream.follow():
                yield out
        finally:
            self._streams.close(stream)
            if not stream.finished and self.dead_error is None and not self._stopping:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when unknown or finished); its blocks free within one step."""
        try:
            self._send(AbortRequest(request_id))
        except (OSError, ValueError):
            pass  # the core is gone: so is the request

    async def stats(self) -> EngineStats:
        value = await asyncio.wrap_future(self._call(lambda call_id: Query(call_id, QueryKind.STATS)))
        assert isinstance(value, EngineStats)
        return value

    async def reset_prefix_cache(self) -> bool:
        return bool(await asyncio.wrap_future(
            self._call(lambda call_id: Query(call_id, QueryKind.RESET_PREFIX_CACHE))))

    async def check_integrity(self) -> None:
        """The core's KV and scheduler integrity check (raises KVIntegrityError there and here)."""
        await asyncio.wrap_future(self._call(lambda call_id: Query(call_id, QueryKind.CHECK_INTEGRITY)))

    # ------------------------------------------------------------ talking to the core

    def _check_alive(self) -> None:
        if self.dead_error is not None or (self._reader is not None and not self._process.is_alive()):
            raise EngineDeadError("the engine loop stopped after an internal error; the server log has the cause")
        if self._reader is None:
            raise EngineDeadError("the engine is not started")

    def _send(self, msg: AddRequest | AbortRequest | Query | Stop) -> None:
        with self._send_lock:
            self._commands.send(msg)

    def _call(self, make: Callable[[int], AddRequest | Query]) -> concurrent.futures.Future[object]:
        """Send the message ``make(call_id)`` and return the future its Reply resolves."""
        self._check_alive()
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        call_id = next(self._call_ids)
        with self._calls_lock:
            self._calls[call_id] = future
        try:
            self._send(make(call_id))
        except (OSError, ValueError):
            with self._calls_lock:
                self._calls.pop(call_id, None)
            raise EngineDeadError("the engine core process is gone; the server log has the cause") from None
        return future

    def _read(self) -> None:
        """Reader thread: outputs to the event loop, replies to their futures, until the pipe closes."""
        loop = self._loop
        assert loop is not None
        try:
            while True:
                msg = self._events.recv()
                if isinstance(msg, Outputs):
                    if self.on_first_scheduled is not None:
                        observe_queue_times(self.on_first_scheduled, msg.outputs)
                    loop.call_soon_threadsafe(self._streams.dispatch, msg.outputs)
                elif isinstance(msg, Reply):
                    with self._calls_lock:
                        future = self._calls.pop(msg.call_id, None)
                    if future is not None and future.set_running_or_notify_cancel():
                        if msg.error is not None:
                            future.set_exception(msg.error)
                        else:
                            future.set_result(msg.value)
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        self._process.join(1)
        log.error("the engine core process exited (exit code %s); the engine is dead", self._process.exitcode)
        err = EngineDeadError("the engine loop stopped after an internal error; the server log has the cause")
        self.dead_error = err
        self._fail_calls(err)
        if not loop.is_closed():
            loop.call_soon_threadsafe(self._streams.fail_all, err)

    def _fail_calls(self, err: BaseException) -> None:
        with self._calls_lock:
            calls, self._calls = self._calls, {}
        for future in calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(err)

    def _close_pipes(self) -> None:
        for conn in (self._commands, self._events):
            try:
                conn.close()
            except OSError:
                pass
