"""Reading a request body: JSON, validation as the endpoint's OpenAI request, session key.

``inspect_body`` turns raw bytes into a ``ParsedBody`` or a ``BodyRejected`` (always a value,
never an exception, so it crosses a process boundary): deep nesting, integers longer than
Python converts, invalid UTF-8 and lone surrogates are client errors (400), not crashes.

``BodyInspector`` runs it inline for small bodies and in a worker process for large ones:
``json.loads`` and pydantic hold the GIL, so a thread would still stall the event loop and
every stream on it (a few MB of chat take a few hundred ms to validate). At most
``max_pending`` large bodies are inspected or waiting at once; more wait their turn. The worker
starts on the first large body, on a thread: starting it (the forkserver, then the worker) blocks
its caller for a few hundred ms, and on the event loop that stalled every stream it relays. A body
the gateway spooled goes to the worker as a ``body_spool.SharedBody`` (its memory file's path),
not pickled: the worker reads it itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from pydantic import ValidationError

from chatfleet.errors import InvalidRequestError
from chatfleet.gateway.session import SessionKey, body_session
from chatfleet.protocol.body_spool import SharedBody, body_bytes, offered_by_name
from chatfleet.protocol.errors import to_chatfleet_error
from chatfleet.protocol.openai import ChatCompletionRequest, CompletionRequest
from chatfleet.protocol.safe_json import MAX_DEPTH, parse_json_body
from chatfleet.protocol.worker_priority import lower_cpu_priority

ENDPOINTS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


@dataclass(frozen=True)
class ParsedBody:
    """What the gateway needs from a valid request body."""

    stream: bool
    model: str | None
    session: SessionKey  # from the body alone (the session header, if any, wins over it)
    continues: bool = False  # the chat carries earlier turns (an assistant message): a returning turn
    prompt_bytes: int = 0  # the prompt's size (messages' or prompt's JSON), for per-key token budgets
    max_tokens: int | None = None  # what the request asks for at most (None: the server's default)
    cache_salt: str | None = None  # the client's own, kept under its tenant's (tenants.py)


@dataclass(frozen=True)
class BodyRejected:
    """The body is not a valid request: a 400 with this message."""

    message: str
    param: str | None = None


def inspect_body(path: str, body: bytes | SharedBody) -> ParsedBody | BodyRejected:
    """Validate ``body`` as the request of endpoint ``path``: parsed as the engine parses it
    (``protocol.safe_json``), then validated by the same request model, so both refuse a body
    with the same message (a shared body read here from the gateway's memory file)."""
    try:
        return _inspect(path, body_bytes(body))
    except RecursionError:  # pydantic on a body nested within the parse's limit but still deep
        return BodyRejected(f"the body: the JSON is nested more than {MAX_DEPTH} levels deep;"
                            f" at most {MAX_DEPTH} levels are allowed")


def _inspect(path: str, body: bytes) -> ParsedBody | BodyRejected:
    try:
        data = parse_json_body(body)
    except InvalidRequestError as exc:
        return BodyRejected(exc.message, exc.param)
    if not isinstance(data, dict):
        return BodyRejected("the request body must be a JSON object")
    try:
        request = ENDPOINTS[path].model_validate(data)
    except ValidationError as exc:
        err = to_chatfleet_error(exc)
        return BodyRejected(err.message, err.param)
    prompt = data.get("messages", data.get("prompt"))
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    return ParsedBody(stream=bool(request.stream), model=request.model, session=body_session(data),
                      continues=carries_earlier_turns(data),
                      prompt_bytes=len(json.dumps(prompt, ensure_ascii=False)) if prompt is not None else 0,
                      max_tokens=max_tokens if isinstance(max_tokens, int) else None,
                      cache_salt=salt if isinstance(salt := data.get("cache_salt"), str) else None)


def carries_earlier_turns(data: dict[str, object]) -> bool:
    """A chat whose messages hold an assistant reply continues a conversation: any gateway can
    tell a returning turn from the request alone, with no state shared."""
    messages = data.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages)


class BodyInspector:
    """``inspect_body`` inline below ``offload_bytes``, in a worker process above it."""

    def __init__(self, offload_bytes: int, workers: int = 1, max_pending: int = 4) -> None:
        self.offload_bytes = offload_bytes
        self.workers = workers
        self._pending = asyncio.Semaphore(max_pending)
        self._pool: ProcessPoolExecutor | None = None
        self._starting = threading.Lock()

    async def inspect(self, path: str, body: bytes, shared: SharedBody | None = None) -> ParsedBody | BodyRejected:
        """``shared``, the same body in a memory file the caller keeps open until this returns,
        goes to the worker instead of the bytes (pickling a large body holds the GIL for a copy)."""
        if len(body) < self.offload_bytes:
            return inspect_body(path, body)
        sent: bytes | SharedBody = shared if shared is not None else body
        loop = asyncio.get_running_loop()

        async def run(this: bytes | SharedBody) -> ParsedBody | BodyRejected:
            return await loop.run_in_executor(await self._executor(), inspect_body, path, this)

        async with self._pending:
            try:
                return await offered_by_name(run, sent, lambda: body)
            except BrokenProcessPool:  # a worker died (killed, out of memory): start afresh
                self.close()
                return await run(sent)

    async def _executor(self) -> ProcessPoolExecutor:
        pool = self._pool
        return pool if pool is not None else await asyncio.to_thread(self._started)

    def _started(self) -> ProcessPoolExecutor:
        """The pool, its workers started and running (called on a thread, never the event loop)."""
        with self._starting:
            if self._pool is None:  # forkserver: never fork a process that runs threads
                pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("forkserver"),
                                           initializer=lower_cpu_priority)
                # Submitted together, each task finds no idle worker and starts one; then wait for all
                # (one at a time, every task after the first would reuse the first idle worker).
                for started in [pool.submit(int) for _ in range(self.workers)]:
                    started.result()
                self._pool = pool
            return self._pool

    @property
    def started(self) -> bool:
        """Whether the worker pool is up (it starts on the first large body)."""
        return self._pool is not None

    def close(self) -> None:
        if self._pool is not None:
            with contextlib.suppress(Exception):
                self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
