"""The engine core in a process of its own: the step loop with nothing else on its interpreter.

``run_core`` is the entry of the process ``engine_process.EngineProcess`` spawns. It builds the
``Engine`` (model, KV pools, scheduler), says ``Ready`` with the facts the HTTP front needs (or
``LoadFailed`` with the refusal), then runs the step loop on its main thread until ``Stop`` or
until the API process goes away (its pipe closes). A receiver thread reads commands and hands
them to the step loop between steps; a request with a grammar waits on the grammar pool until
its grammar is compiled, off the step loop and without holding up other commands.

Why a process: in one process the step loop shares the GIL with the event loop's HTTP work
(parsing, SSE framing, JSON of every streamed token), and each waits for the other; vLLM runs its
engine core apart from its API server for the same reason. Here the step loop is alone, and the
API process's work runs on another core. Each step's outputs go back as one message.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from multiprocessing.connection import Connection

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
from chatfleet.engine.config import EngineConfig
from chatfleet.engine.console_log import console_logging
from chatfleet.engine.engine import Engine
from chatfleet.errors import ChatfleetError, InvalidRequestError
from chatfleet.protocol.startup_gc import freeze_startup_objects
from chatfleet.protocol.switch_interval import shorten_switch_interval

CORE_PROCESS_NAME = "chatfleet-core"  # the core's name in ps and /proc/PID/comm

log = logging.getLogger(__name__)

__all__ = ["run_core"]

Command = AddRequest | AbortRequest | Query | Stop


def run_core(config: EngineConfig, commands: Connection, events: Connection, log_level: str | None = None,
             check_integrity_when_idle: bool = False) -> None:
    """Build the engine, say Ready (or LoadFailed), then step until Stop or the API process is gone."""
    name_this_process(CORE_PROCESS_NAME)
    if log_level is not None:
        console_logging(log_level)
    try:
        engine = Engine(config)
    except ChatfleetError as exc:
        events.send(LoadFailed(exc))
        return
    except Exception as exc:  # noqa: BLE001 - reported to the API process as a one-line refusal
        log.exception("the engine could not be built")
        events.send(LoadFailed(ChatfleetError(f"the engine could not be built: {type(exc).__name__}: {exc}")))
        return
    facts = CoreFacts(
        model_name=engine.model_name, max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
        max_request_tokens=engine.max_request_tokens, kv_cache_tokens=getattr(engine.kv, "total_tokens", None),
        memory=engine.memory, grammars=engine.structured is not None, pid=os.getpid())
    shorten_switch_interval()  # the step loop gets the GIL back soon behind the receiver's unpickling
    freeze_startup_objects()  # the model: no full GC pass walks it again
    events.send(Ready(facts))
    try:
        CoreLoop(engine, commands, events, check_integrity_when_idle).run()
    except BaseException:  # the API process sees the pipe close and answers 503 from then on
        log.exception("engine loop crashed")
        raise


def name_this_process(name: str) -> None:
    """Name the process as ``ps``, ``top`` and ``/proc/PID/comm`` show it (Linux; elsewhere nothing)."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


class CoreLoop:
    """The step loop of the core process: commands from ``commands`` between steps, each step's
    outputs and every reply to ``events`` (written from the loop's thread only)."""

    def __init__(self, engine: Engine, commands: Connection, events: Connection,
                 check_integrity_when_idle: bool = False) -> None:
        self.engine = engine
        self.commands = commands
        self.events = events
        self.check_integrity_when_idle = check_integrity_when_idle
        self._cond = threading.Condition()
        self._inbox: list[Command] = []
        self._compiling: set[str] = set()  # requests waiting for their grammar
        self._aborted_early: set[str] = set()  # of those, the ones aborted meanwhile

    def run(self) -> None:
        receiver = threading.Thread(target=self._receive, name="chatfleet-core-receiver", daemon=True)
        receiver.start()
        engine = self.engine
        checked_idle = True
        while True:
            with self._cond:
                while not (self._inbox or engine.has_unfinished_requests()):
                    if self.check_integrity_when_idle and not checked_idle:
                        break
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
            for cmd in inbox:
                if isinstance(cmd, Stop):
                    return
                self._apply(cmd)
            if engine.has_unfinished_requests():
                checked_idle = False
                outputs = engine.step()
                if outputs:
                    self.events.send(Outputs(outputs))
            elif self.check_integrity_when_idle and not checked_idle:
                engine.check_integrity()
                checked_idle = True

    # ------------------------------------------------------------ receiver thread

    def _receive(self) -> None:
        structured = self.engine.structured
        while True:
            try:
                cmd = self.commands.recv()
            except (EOFError, OSError):  # the API process is gone: nobody to serve
                self._post(Stop())
                return
            if isinstance(cmd, AddRequest) and cmd.params.grammar is not None and structured is not None:
                with self._cond:
                    self._compiling.add(cmd.request_id)
                pending = structured.compiler.submit(cmd.params.grammar)  # add_request then finds it compiled
                pending.add_done_callback(functools.partial(self._compiled, cmd))
                continue
            if isinstance(cmd, AbortRequest):
                with self._cond:
                    if cmd.request_id in self._compiling:
                        self._aborted_early.add(cmd.request_id)
            self._post(cmd)
            if isinstance(cmd, Stop):
                return

    def _compiled(self, cmd: AddRequest, _done: object) -> None:
        with self._cond:
            self._compiling.discard(cmd.request_id)
            self._inbox.append(cmd)
            self._cond.notify()

    def _post(self, cmd: Command) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    # ------------------------------------------------------------ step loop thread

    def _apply(self, cmd: AddRequest | AbortRequest | Query) -> None:
        engine = self.engine
        if isinstance(cmd, AbortRequest):
            engine.abort_request(cmd.request_id)
            return
        try:
            if isinstance(cmd, AddRequest):
                with self._cond:
                    aborted = cmd.request_id in self._aborted_early
                    self._aborted_early.discard(cmd.request_id)
                if aborted:  # its client left while its grammar compiled
                    raise InvalidRequestError(f"request {cmd.request_id!r} was aborted before it started")
                engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, arrival_time=cmd.arrival_time,
                                   cache_salt=cmd.cache_salt, session_id=cmd.session_id)
                value: object = None
            elif cmd.kind is QueryKind.STATS:
                value = engine.stats()
            elif cmd.kind is QueryKind.RESET_PREFIX_CACHE:
                value = engine.reset_prefix_cache()
            else:
                engine.check_integrity()
                value = None
        except ChatfleetError as exc:
            self.events.send(Reply(cmd.call_id, error=exc))
        except Exception as exc:  # noqa: BLE001 - a foreign error fails this command only
            log.exception("engine command failed")
            self.events.send(Reply(cmd.call_id, error=ChatfleetError(f"{type(exc).__name__}: {exc}")))
        else:
            self.events.send(Reply(cmd.call_id, value))
