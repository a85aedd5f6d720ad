"""A server whose engine died stops, so that whatever supervises it starts a new one.

After the engine's step loop dies (the core process killed or crashed, or the engine thread's
internal error) the server fails every open stream, answers 503 on ``/health`` and 500 on new
requests. Left at that it would stay up answering only errors until someone restarts it: `chatfleet
serve` restarts a replica only when its process exits, and a probe may not be configured.
vLLM's API server shuts down when its engine core dies; so does this one. ``DeadEngineWatch``
polls the engine from a thread of its own and, ``grace_s`` after it died (time for the open
streams' error events to leave and for a probe to see 503), calls ``stop`` once; ``run_server``
then exits with status 1.

States: watching -> (the engine's ``dead_error`` set) -> grace -> fired (``stop`` called; final).
``close()`` ends the watch in any state but fired without calling ``stop``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger("chatfleet.engine")

DEFAULT_GRACE_S = 2.0
DEFAULT_POLL_S = 0.25


class HasDeadError(Protocol):
    @property
    def dead_error(self) -> BaseException | None: ...


class DeadEngineWatch:
    """Calls ``stop()`` once, ``grace_s`` after ``engine.dead_error`` is first seen set."""

    def __init__(self, engine: HasDeadError, stop: Callable[[], None], grace_s: float = DEFAULT_GRACE_S,
                 poll_s: float = DEFAULT_POLL_S) -> None:
        if grace_s < 0 or poll_s <= 0:
            raise ValueError("grace_s must be >= 0 and poll_s > 0")
        self._engine, self._stop, self.grace_s, self.poll_s = engine, stop, grace_s, poll_s
        self._closed = threading.Event()
        self.fired = False
        self._thread = threading.Thread(target=self._watch, name="chatfleet-dead-engine-watch", daemon=True)

    def start(self) -> DeadEngineWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.poll_s + self.grace_s + 1.0)

    def _watch(self) -> None:
        while not self._closed.wait(self.poll_s):
            if self._engine.dead_error is not None:
                break
        else:
            return
        log.error("the engine is dead: the server stops in %.1f s (exit status 1) for its supervisor to"
                  " start a new one", self.grace_s)
        if self._closed.wait(self.grace_s):
            return
        self.fired = True
        self._stop()
