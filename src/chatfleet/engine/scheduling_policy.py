"""Scheduling policies: the order of the waiting queue and the choice of preemption victims.

A policy owns the waiting queue. The scheduler ``push``es new requests, ``push_front``s preempted
ones, admits from ``peek()`` and asks ``select_victim`` which running request to preempt when the
pool is full. Policies are registered by name (``SchedulerConfig.policy``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Callable, Protocol

from chatfleet.engine.request import Request
from chatfleet.errors import ConfigError


class SchedulingPolicy(Protocol):
    name: str

    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
    def peek(self) -> Request | None: ...
    def pop(self, request: Request) -> None: ...
    def remove(self, request: Request) -> bool: ...
    def select_victim(self, candidates: Sequence[Request]) -> Request: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSPolicy:
    """First come, first served; a preempted request goes back to the front of the queue.

    The victim is the latest-arrived candidate, so the oldest request always makes progress.
    Admission is head-of-line: if the first waiting request does not fit, nothing behind it runs.
    """

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)

    def remove(self, request: Request) -> bool:
        try:
            self._queue.remove(request)
        except ValueError:
            return False
        return True

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        return max(reversed(candidates), key=lambda r: r.arrival_time)  # ties: the later one

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


# A later "longest-cached-prefix-first" policy registers here; it may take the KV manager.
SCHEDULING_POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
}


def make_scheduling_policy(name: str) -> SchedulingPolicy:
    try:
        return SCHEDULING_POLICIES[name]()
    except KeyError:
        valid = ", ".join(sorted(SCHEDULING_POLICIES))
        raise ConfigError(f"unknown scheduling policy {name!r}; valid: {valid}") from None
