"""Admission control: per-replica in-flight caps and one bounded priority queue.

A request holds a slot on its replica from admission until its response ends or its client
leaves. When the replica is at its cap the request waits, at most ``max_wait_s``, in that
replica's queue; returning turns of conversations in progress go before first turns (FIFO
within each class). All replicas' queues together hold at most ``queue_size`` requests, of which
at most ``max_queued_new`` first turns; beyond that a request is shed at once, except that a
returning turn displaces the newest queued first turn. So above the caps new conversations are
shed before the returning turns of conversations in progress. A replica that goes down hands
its waiters back to be routed again. Replicas join (``add``) and leave (``remove``, once idle)
as discovery changes the fleet; ``on_idle`` hears of a replica whose last slot was released.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field


class Priority(enum.IntEnum):
    RETURNING = 0  # a later turn of a conversation in progress
    FIRST = 1  # the first turn of a new conversation (or unknown)


class Outcome(str, enum.Enum):
    ADMITTED = "admitted"
    SHED = "shed"  # answer 429 with Retry-After
    REROUTE = "reroute"  # the replica went down while the request waited


@dataclass(frozen=True)
class AdmissionDecision:
    outcome: Outcome
    replica: str
    waited_s: float
    reason: str  # free_slot, dequeued, queue_full, new_queue_full, wait_timeout, displaced, replica_down
    retry_after_s: float = 0.0

    @property
    def admitted(self) -> bool:
        return self.outcome is Outcome.ADMITTED


def _cancelling() -> bool:
    """The running task has a cancellation pending (its client left)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


@dataclass(order=True)
class _Waiter:
    priority: int
    seq: int
    future: asyncio.Future[Outcome] = field(compare=False)


@dataclass
class _Slots:
    cap: float
    in_flight: int = 0
    queued: int = 0
    heap: list[_Waiter] = field(default_factory=list)


class AdmissionController:
    def __init__(self, caps: Mapping[str, int | None], *, queue_size: int, max_wait_s: float,
                 retry_after_s: float, max_queued_new: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_idle: Callable[[str], object] | None = None) -> None:
        self._slots = {r: _Slots(cap=math.inf if c is None else c) for r, c in caps.items()}
        self.on_idle = on_idle
        self.queue_size = queue_size
        self.max_queued_new = queue_size if max_queued_new is None else max_queued_new
        self.max_wait_s = max_wait_s
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._seq = itertools.count()
        self.queued_total = 0
        self.queued_new = 0  # first turns among them

    # -- state -------------------------------------------------------------------------------
    def cap(self, replica: str) -> float:
        return self._slots[replica].cap

    def in_flight(self, replica: str) -> int:
        return self._slots[replica].in_flight

    def queued(self, replica: str) -> int:
        return self._slots[replica].queued

    def load(self, replica: str) -> int:
        s = self._slots[replica]
        return s.in_flight + s.queued

    def is_full(self, replica: str) -> bool:
        """No slot free right now (or others already wait for one)."""
        s = self._slots[replica]
        return s.in_flight >= s.cap or s.queued > 0

    def loads(self) -> dict[str, int]:
        return {r: s.in_flight + s.queued for r, s in self._slots.items()}

    def is_idle(self, replica: str) -> bool:
        s = self._slots[replica]
        return s.in_flight == 0 and s.queued == 0

    # -- membership --------------------------------------------------------------------------
    def add(self, replica: str, cap: int | None) -> None:
        """A replica joined (no-op for a member)."""
        self._slots.setdefault(replica, _Slots(cap=math.inf if cap is None else cap))

    def remove(self, replica: str) -> None:
        """Forget an idle replica."""
        assert self.is_idle(replica), f"{replica} still holds requests"
        del self._slots[replica]

    # -- admission ---------------------------------------------------------------------------
    async def admit(self, replica: str, priority: Priority, deadline: float) -> AdmissionDecision:
        """Take a slot on ``replica``, waiting in its queue until ``deadline`` at most."""
        slots = self._slots[replica]
        start = self._clock()
        if slots.in_flight < slots.cap and slots.queued == 0:
            slots.in_flight += 1
            return AdmissionDecision(Outcome.ADMITTED, replica, 0.0, "free_slot")
        if self.max_wait_s <= 0 or deadline <= start:
            return self._shed(replica, 0.0, "wait_timeout")
        if self.queued_total >= self.queue_size and not (
            priority is Priority.RETURNING and self._displace_newest_first_turn()
        ):
            return self._shed(replica, 0.0, "queue_full")
        if priority is Priority.FIRST and self.queued_new >= self.max_queued_new:
            return self._shed(replica, 0.0, "new_queue_full")
        waiter = _Waiter(int(priority), next(self._seq), asyncio.get_running_loop().create_future())
        heapq.heappush(slots.heap, waiter)
        slots.queued += 1
        self.queued_total += 1
        self.queued_new += priority is Priority.FIRST
        try:
            await asyncio.wait((waiter.future,), timeout=deadline - start)
        finally:
            if not waiter.future.done():  # timed out, or our task was cancelled (client left)
                waiter.future.cancel()
                self._dequeued(slots, waiter)
                self._compact(slots)
            elif waiter.future.result() is Outcome.ADMITTED and _cancelling():
                self.release(replica)  # granted just as the client left
        waited = self._clock() - start
        outcome = waiter.future.result() if not waiter.future.cancelled() else Outcome.SHED
        if outcome is Outcome.ADMITTED:
            return AdmissionDecision(Outcome.ADMITTED, replica, waited, "dequeued")
        if outcome is Outcome.REROUTE:
            return AdmissionDecision(Outcome.REROUTE, replica, waited, "replica_down")
        reason = "displaced" if not waiter.future.cancelled() else "wait_timeout"
        return self._shed(replica, waited, reason)

    def release(self, replica: str) -> None:
        """Give back a slot; the replica's best waiter (if any) takes it."""
        slots = self._slots[replica]
        slots.in_flight -= 1
        assert slots.in_flight >= 0, f"slot released twice on {replica}"
        while slots.heap and slots.in_flight < slots.cap:
            waiter = heapq.heappop(slots.heap)
            if waiter.future.done():
                continue
            waiter.future.set_result(Outcome.ADMITTED)
            slots.in_flight += 1
            self._dequeued(slots, waiter)
        if self.on_idle is not None and slots.in_flight == 0 and slots.queued == 0:
            self.on_idle(replica)

    def drain(self, replica: str) -> int:
        """The replica went down: its waiters get REROUTE. Returns how many there were."""
        slots = self._slots[replica]
        count = 0
        for waiter in slots.heap:
            if not waiter.future.done():
                waiter.future.set_result(Outcome.REROUTE)
                self._dequeued(slots, waiter)
                count += 1
        slots.heap.clear()
        return count

    # -- internals ---------------------------------------------------------------------------
    def _shed(self, replica: str, waited: float, reason: str) -> AdmissionDecision:
        return AdmissionDecision(Outcome.SHED, replica, waited, reason, self.retry_after_s)

    def _dequeued(self, slots: _Slots, waiter: _Waiter) -> None:
        slots.queued -= 1
        self.queued_total -= 1
        self.queued_new -= waiter.priority == Priority.FIRST

    def _compact(self, slots: _Slots) -> None:
        if len(slots.heap) > 2 * slots.queued + 64:
            slots.heap = [w for w in slots.heap if not w.future.done()]
            heapq.heapify(slots.heap)

    def _displace_newest_first_turn(self) -> bool:
        newest: tuple[_Waiter, _Slots] | None = None
        for slots in self._slots.values():
            for waiter in slots.heap:
                if (waiter.priority == Priority.FIRST and not waiter.future.done()
                        and (newest is None or waiter.seq > newest[0].seq)):
                    newest = (waiter, slots)
        if newest is None:
            return False
        waiter, slots = newest
        waiter.future.set_result(Outcome.SHED)
        self._dequeued(slots, waiter)
        return True
