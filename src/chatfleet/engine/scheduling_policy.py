"""Scheduling policies: the order of the waiting queue and the choice of preemption victims.

A policy owns the waiting queue. The scheduler ``push``es new requests, ``push_front``s
preempted ones, asks ``candidates(now, limit)`` for the requests to try admitting this step, in
order, and asks ``select_victim`` which running request to preempt when the pool is full. A
policy built by name (``SchedulerConfig.policy``, one registry) gets the KV manager, its
settings (``PolicySettings``: the fields of ``SchedulerConfig`` it reads; the config checks
its policy name here, so this module does not import the config) and the clock.

- ``fcfs`` (stock): arrival order, head-of-line: if the first request does not fit, nothing
  behind it starts.
- ``lpm``: longest cached prefix first (device hits at full weight, host-tier hits weighted by
  ``lpm_host_weight``, their reload cost), over the whole queue, with no cap on its length.
  Not head-of-line: a request that fits may start while a larger one waits for memory, unless
  the waiting one is overdue. A preempted request, or one waiting longer than
  ``max_queue_delay`` seconds, goes first (in arrival order) and blocks the requests behind it
  until it fits: nothing starves.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from chatfleet.engine.request import Request, RequestStatus
from chatfleet.registry import Registry

if TYPE_CHECKING:
    from chatfleet.engine.kv.base import KVManager

Clock = Callable[[], float]


class PolicySettings(Protocol):
    """What a policy reads of the scheduler's config (``SchedulerConfig`` is one)."""

    @property
    def max_queue_delay(self) -> float: ...  # seconds after which a waiting request goes first (lpm)
    @property
    def lpm_host_weight(self) -> float: ...  # a host-tier hit token's weight against a device hit (lpm)


class SchedulingPolicy(Protocol):
    name: str
    head_of_line: bool  # when a candidate does not fit, stop admitting this step

    def push(self, request: Request) -> None: ...
    def push_front(self, request: Request) -> None: ...
    def candidates(self, now: float, limit: int) -> list[Request]: ...
    def is_overdue(self, request: Request, now: float) -> bool: ...
    def pop(self, request: Request) -> None: ...
    def remove(self, request: Request) -> bool: ...
    def select_victim(self, candidates: Sequence[Request]) -> Request: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


SCHEDULING_POLICIES: Registry[SchedulingPolicy] = Registry("scheduling policy")


def latest_arrival(candidates: Sequence[Request]) -> Request:
    """The victim: the latest-arrived candidate, so the oldest request always makes progress."""
    return max(reversed(candidates), key=lambda r: r.arrival_time)  # ties: the later one


@SCHEDULING_POLICIES.register("fcfs")
class FCFSPolicy:
    """First come, first served; a preempted request goes back to the front of the queue.

    Admission is head-of-line: if the first waiting request does not fit, nothing behind it runs.
    """

    name = "fcfs"
    head_of_line = True

    def __init__(self, kv: KVManager | None = None, config: PolicySettings | None = None,
                 clock: Clock = time.monotonic) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request | None:
        return self._queue[0] if self._queue else None

    def candidates(self, now: float, limit: int) -> list[Request]:
        return list(itertools.islice(self._queue, max(limit, 0)))

    def is_overdue(self, request: Request, now: float) -> bool:
        return True

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
        return latest_arrival(candidates)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


@SCHEDULING_POLICIES.register("lpm")
class LongestPrefixMatchPolicy:
    """Longest cached prefix first, with a max-wait guard (see the module docstring).

    Scores are cached per request. Each step rescores new requests and, round robin, up to
    ``refresh_per_step`` of the others (a match walks the request's cached block hashes, no
    hashing); the scheduler re-matches a request exactly when it admits it. Choosing the
    candidates is one pass over the queue (O(n log limit)), however long the queue is.
    """

    name = "lpm"
    head_of_line = False

    def __init__(self, kv: KVManager, config: PolicySettings, clock: Clock = time.monotonic,
                 refresh_per_step: int = 32) -> None:
        self.kv = kv
        self.max_queue_delay = config.max_queue_delay
        self.host_weight = config.lpm_host_weight
        self.refresh_per_step = refresh_per_step
        self._queue: dict[str, Request] = {}  # insertion order = arrival order (preempted: first)
        self._front: dict[str, Request] = {}  # preempted requests, go first
        self._scores: dict[str, float] = {}
        self._stale: deque[str] = deque()  # round-robin order of rescoring

    def _score(self, request: Request) -> float:
        m = self.kv.match_prefix(request)
        return m.device_tokens + self.host_weight * m.host_tokens

    def push(self, request: Request) -> None:
        self._queue[request.request_id] = request
        self._scores[request.request_id] = self._score(request)
        self._stale.append(request.request_id)

    def push_front(self, request: Request) -> None:
        self._front[request.request_id] = request
        self.push(request)

    def is_overdue(self, request: Request, now: float) -> bool:
        return (request.status == RequestStatus.PREEMPTED
                or now - request.arrival_time > self.max_queue_delay)

    def _refresh_scores(self) -> None:
        refreshed = 0
        while self._stale and refreshed < self.refresh_per_step:
            rid = self._stale.popleft()
            request = self._queue.get(rid)
            if request is None:
                continue  # left the queue
            self._scores[rid] = self._score(request)
            self._stale.append(rid)
            refreshed += 1
            if refreshed >= len(self._queue):
                break

    def candidates(self, now: float, limit: int) -> list[Request]:
        if limit <= 0 or not self._queue:
            return []
        self._refresh_scores()
        overdue = list(self._front.values())
        rest = []
        deadline = now - self.max_queue_delay
        for r in self._queue.values():
            if r.arrival_time < deadline:
                if r.request_id not in self._front:
                    overdue.append(r)
            elif r.request_id not in self._front:
                rest.append(r)
        if len(overdue) >= limit:
            overdue.sort(key=lambda r: (r.request_id not in self._front, r.arrival_time))
            return overdue[:limit]
        overdue.sort(key=lambda r: (r.request_id not in self._front, r.arrival_time))
        scores = self._scores
        best = heapq.nsmallest(limit - len(overdue), rest,
                               key=lambda r: (-scores[r.request_id], r.arrival_time))
        return overdue + best

    def pop(self, request: Request) -> None:
        self.remove(request)

    def remove(self, request: Request) -> bool:
        rid = request.request_id
        self._front.pop(rid, None)
        self._scores.pop(rid, None)
        return self._queue.pop(rid, None) is not None

    def select_victim(self, candidates: Sequence[Request]) -> Request:
        return latest_arrival(candidates)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue.values()))


def make_scheduling_policy(name: str, kv: KVManager | None = None, config: PolicySettings | None = None,
                           clock: Clock = time.monotonic) -> SchedulingPolicy:
    return SCHEDULING_POLICIES.make(name, kv, config, clock)
