"""What the API process and the engine-core process say to each other (``engine_process.py``,
``core_process.py``), as plain frozen values sent over two pipes.

To the core (one pipe, read by the core's receiver thread): ``AddRequest``, ``AbortRequest``,
``Query`` (stats, prefix-cache reset, integrity check; answered by a ``Reply``) and ``Stop``.
From the core (one pipe, written only by its step loop): ``Ready`` once the model is loaded (the
facts the HTTP front needs) or ``LoadFailed``; then ``Outputs`` (one step's outputs, in one
message) and ``Reply`` (to an ``AddRequest`` or a ``Query``, by its ``call_id``).

Errors travel as values: a ``Reply`` carries the ``ChatfleetError`` the engine raised (an
exception pickles with its attributes: message, parameter, code); anything else becomes a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.sizing.memory import MemoryBreakdown
from chatfleet.errors import ChatfleetError

__all__ = ["AbortRequest", "AddRequest", "CoreFacts", "LoadFailed", "Outputs", "Query", "QueryKind", "Ready",
           "Reply", "Stop"]


@dataclass(frozen=True)
class AddRequest:
    call_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None  # time.monotonic() of the API process (one clock on Linux), or None: at add
    cache_salt: str | None
    session_id: str | None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


class QueryKind(Enum):
    STATS = "stats"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    CHECK_INTEGRITY = "check_integrity"


@dataclass(frozen=True)
class Query:
    call_id: int
    kind: QueryKind


@dataclass(frozen=True)
class Stop:
    """Finish the step loop and exit (the API process is shutting down)."""


@dataclass(frozen=True)
class CoreFacts:
    """What the HTTP front reads of the engine, settled once the model is loaded."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_request_tokens: int
    kv_cache_tokens: int | None
    memory: MemoryBreakdown | None
    grammars: bool  # the engine can build grammars' token masks (structured output)
    pid: int


@dataclass(frozen=True)
class Ready:
    facts: CoreFacts


@dataclass(frozen=True)
class LoadFailed:
    """The core could not build its engine; ``error`` says why (a ChatfleetError: a one-line refusal)."""

    error: ChatfleetError


@dataclass(frozen=True)
class Outputs:
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: object = None
    error: ChatfleetError | None = None
