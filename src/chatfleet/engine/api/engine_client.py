"""What the HTTP front needs of an engine: ``EngineClient``.

Two implement it: ``async_engine.AsyncEngine`` (the engine on a thread of the server's own
process: tests, embedding) and ``engine_process.EngineProcess`` (the engine core in a process of
its own, what ``chatfleet engine`` serves by default).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from typing import Protocol

from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.sizing.memory import MemoryBreakdown
from chatfleet.engine.stats import EngineStats
from chatfleet.engine.structured.compiler import GrammarCompiler
from chatfleet.engine.tokenizer import ChatTokenizer

__all__ = ["EngineClient"]


class EngineClient(Protocol):
    """An engine as the routes see it: facts, a stream per request, stats, admin calls, lifecycle."""

    on_first_scheduled: Callable[[float], None] | None  # queue-time observer: first scheduled - arrival (s)

    @property
    def tokenizer(self) -> ChatTokenizer: ...
    @property
    def model_name(self) -> str: ...
    @property
    def grammar_compiler(self) -> GrammarCompiler | None: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def memory(self) -> MemoryBreakdown | None: ...
    @property
    def kv_cache_tokens(self) -> int | None: ...
    @property
    def max_request_tokens(self) -> int: ...
    @property
    def is_alive(self) -> bool: ...
    @property
    def dead_error(self) -> BaseException | None: ...  # why the step loop died (None: it has not)
    @property
    def num_streams(self) -> int: ...

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None: ...
    def shutdown(self, timeout: float = 10.0) -> None: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                 arrival_time: float | None = None, cache_salt: str | None = None,
                 session_id: str | None = None) -> AsyncGenerator[RequestOutput, None]: ...
    def abort(self, request_id: str) -> None: ...
    async def stats(self) -> EngineStats: ...
    async def reset_prefix_cache(self) -> bool: ...
