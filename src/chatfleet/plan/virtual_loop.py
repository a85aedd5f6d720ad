"""An asyncio event loop that runs in virtual time.

``loop.time()`` reads a ``VirtualClock``; when nothing is ready to run, the loop's selector
moves the clock to the next timer instead of sleeping. ``asyncio.sleep``, ``asyncio.wait(...,
timeout=...)`` and ``asyncio.timeout`` therefore take no wall time, and code written for real
time (the gateway's admission controller, given ``clock=clock``) runs unchanged. Nothing may
wait on real I/O in such a loop: a wait with no timer pending is a deadlock and raises.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import gc
import heapq
import itertools
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, TypeVarTuple

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


class VirtualClock:
    """Seconds of virtual time; callable like ``time.monotonic``."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance_to(self, t: float) -> None:
        if t > self.now:
            self.now = t


class _VirtualSelector(selectors.SelectSelector):
    _fd_to_key: dict[int, selectors.SelectorKey]  # the base selector's own map (typeshed omits it)

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock
        self.next_timer: Callable[[], float | None] = lambda: None
        self.poked = False  # a thread woke the loop through its self-pipe (``_write_to_self``)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # A real (never blocking) select only where something can be there: the self-pipe after
        # a wake-up from another thread, or a file a caller registered. Most iterations of a
        # simulation have neither, and the system call was the loop's largest single cost.
        if self.poked or len(self._fd_to_key) > 1:
            self.poked = False
            ready = super().select(0)
            if ready:
                return ready
        if timeout == 0:
            return []
        if timeout is None:
            raise RuntimeError("virtual-time loop: every task waits and no timer is pending (deadlock)")
        # land exactly on the timer (``now + (when - now)`` may miss it by a rounding error)
        when = self.next_timer()
        self.clock.advance_to(when if when is not None else self.clock.now + timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """Besides ``time()``: ``next_timer()``, when the earliest pending timer fires (the selector
    jumps the clock there when nothing else is ready), and ``idle_before(t)``."""

    # asyncio's own state that this loop reads (base_events / selector_events; typeshed omits it)
    _ready: collections.deque[asyncio.Handle]
    _stopping: bool
    _selector: _VirtualSelector
    _process_events: Callable[[list[tuple[selectors.SelectorKey, int]]], None]
    _check_closed: Callable[[], None]

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._timer_seq = itertools.count()
        selector = _VirtualSelector(clock)
        super().__init__(selector)
        selector.next_timer = self.next_timer
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.clock.now

    # ---- timers: a heap of (when, sequence, handle), compared in C --------------------------
    # asyncio keeps TimerHandles in its heap and orders them with a Python ``__lt__``: with a few
    # hundred chats' timers pending, a simulated hour spent seconds in those comparisons. Same
    # contract: a handle runs once its time is reached, ties in the order they were scheduled.
    def call_at(self, when: float, callback: Callable[[*Ts], object], *args: *Ts,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        if timer._source_traceback:  # type: ignore[attr-defined]  # asyncio's debug-mode record
            del timer._source_traceback[-1]  # type: ignore[attr-defined]
        heapq.heappush(self._timers, (when, next(self._timer_seq), timer))
        timer._scheduled = True  # type: ignore[attr-defined]  # asyncio's private flag (not in typeshed)
        return timer

    def _run_once(self) -> None:
        """One iteration, as asyncio's: ready callbacks run after the timers now due join them."""
        timers, ready = self._timers, self._ready
        while timers and timers[0][2]._cancelled:  # cancelled ones are dropped when they surface
            heapq.heappop(timers)[2]._scheduled = False  # type: ignore[attr-defined]  # as in call_at
        if ready or self._stopping:
            timeout: float | None = 0
        elif timers:
            timeout = max(0.0, timers[0][0] - self.clock.now)
        else:
            timeout = None
        self._process_events(self._selector.select(timeout))
        end_time = self.clock.now + self._clock_resolution
        while timers and timers[0][0] < end_time:
            handle = heapq.heappop(timers)[2]
            handle._scheduled = False  # type: ignore[attr-defined]  # as in call_at
            ready.append(handle)
        for _ in range(len(ready)):
            callback = ready.popleft()
            if not callback._cancelled:
                callback._run()

    def close(self) -> None:
        self._timers.clear()
        super().close()

    def _write_to_self(self) -> None:  # call_soon_threadsafe's wake-up: the next select looks
        super()._write_to_self()  # type: ignore[misc]  # asyncio's private self-pipe write (not in typeshed)
        self._selector.poked = True

    def idle_before(self, t: float) -> bool:
        """Nothing is ready to run and no timer fires at or before ``t``: a callback that would
        schedule itself at ``t`` may advance the clock and run there at once (the loop would
        jump straight to it)."""
        if self._ready:  # asyncio's queue of callbacks to run now (base_events.BaseEventLoop)
            return False
        when = self.next_timer()
        return when is None or when > t

    def next_timer(self) -> float | None:
        """When the earliest pending timer fires (a cancelled one may answer early), or None."""
        timers = self._timers
        return timers[0][0] if timers else None


# A simulation allocates millions of small objects that live for a step; the collector's default
# first threshold (700) runs it so often that it costs several percent of a long run.
GC_THRESHOLDS = (300_000, 20, 1000)


def run_virtual(coro: Coroutine[Any, Any, T], clock: VirtualClock) -> T:
    """Run ``coro`` to completion on a fresh virtual-time loop driven by ``clock`` (with the
    cyclic garbage collector run less often meanwhile)."""
    loop = VirtualTimeLoop(clock)
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        return loop.run_until_complete(coro)
    finally:
        gc.set_threshold(*thresholds)
        loop.close()
