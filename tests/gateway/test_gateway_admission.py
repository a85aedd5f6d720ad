"""Admission: caps, priority queue (returning turns first), shedding, wait limit, reroute."""

from __future__ import annotations

import asyncio
import random
import time

from chatfleet.gateway.admission import AdmissionController, Outcome, Priority

A, B = "http://a", "http://b"
FAR = 1e18


def controller(cap=1, queue_size=8, max_wait_s=60.0):
    return AdmissionController({A: cap, B: cap}, queue_size=queue_size, max_wait_s=max_wait_s,
                               retry_after_s=2.0)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_cap_then_queue_then_slot_on_release():
    async def run():
        ac = controller(cap=2)
        first = [await ac.admit(A, Priority.FIRST, FAR) for _ in range(2)]
        assert all(d.admitted and d.reason == "free_slot" for d in first)
        waiting = asyncio.create_task(ac.admit(A, Priority.FIRST, FAR))
        await settle()
        assert not waiting.done() and ac.queued(A) == 1 and ac.load(A) == 3
        assert (await ac.admit(B, Priority.FIRST, FAR)).admitted  # other replica unaffected
        ac.release(A)
        decision = await waiting
        assert decision.admitted and decision.reason == "dequeued"
        assert ac.in_flight(A) == 2 and ac.queued(A) == 0
    asyncio.run(run())


def test_returning_turns_go_before_first_turns():
    async def run():
        ac = controller(cap=1)
        await ac.admit(A, Priority.FIRST, FAR)
        order = []

        async def wait(name, priority):
            await ac.admit(A, priority, FAR)
            order.append(name)

        tasks = []
        for name, prio in [("new1", Priority.FIRST), ("new2", Priority.FIRST),
                           ("back1", Priority.RETURNING), ("back2", Priority.RETURNING)]:
            tasks.append(asyncio.create_task(wait(name, prio)))
            await settle()
        for _ in range(4):
            ac.release(A)
            await settle()
        await asyncio.gather(*tasks)
        assert order == ["back1", "back2", "new1", "new2"]
    asyncio.run(run())


def test_full_queue_sheds_at_once_with_retry_after():
    async def run():
        ac = controller(cap=1, queue_size=2)
        await ac.admit(A, Priority.FIRST, FAR)
        await ac.admit(B, Priority.FIRST, FAR)
        queued = [asyncio.create_task(ac.admit(r, Priority.FIRST, FAR)) for r in (A, B)]
        await settle()
        # The queue bound is shared by all replicas. Nothing is released and the deadline is far,
        # so an answer at all means it was shed without waiting (the bound only guards a hang).
        shed = await asyncio.wait_for(ac.admit(A, Priority.FIRST, FAR), 60)
        assert shed.outcome is Outcome.SHED and shed.reason == "queue_full" and shed.retry_after_s == 2.0
        ac.release(A), ac.release(B)
        assert all(d.admitted for d in await asyncio.gather(*queued))
    asyncio.run(run())


def test_returning_turn_displaces_the_newest_first_turn():
    async def run():
        ac = controller(cap=1, queue_size=2)
        await ac.admit(A, Priority.FIRST, FAR)
        old = asyncio.create_task(ac.admit(A, Priority.FIRST, FAR))
        await settle()
        new = asyncio.create_task(ac.admit(A, Priority.FIRST, FAR))
        await settle()
        back = asyncio.create_task(ac.admit(A, Priority.RETURNING, FAR))
        await settle()
        displaced = await new
        assert displaced.outcome is Outcome.SHED and displaced.reason == "displaced"
        assert ac.queued_total == 2
        ac.release(A)
        assert (await back).admitted
        ac.release(A)
        assert (await old).admitted
    asyncio.run(run())


def test_wait_limit_sheds_and_frees_the_queue_place():
    async def run():
        ac = controller(cap=1, max_wait_s=0.05)
        await ac.admit(A, Priority.FIRST, FAR)
        decision = await ac.admit(A, Priority.FIRST, time.monotonic() + 0.05)
        assert decision.outcome is Outcome.SHED and decision.reason == "wait_timeout"
        assert decision.waited_s >= 0.04
        assert ac.queued_total == 0 and ac.in_flight(A) == 1
    asyncio.run(run())


def test_zero_queue_sheds_everything_over_the_cap():
    async def run():
        ac = controller(cap=1, queue_size=0)
        assert (await ac.admit(A, Priority.FIRST, FAR)).admitted
        assert (await ac.admit(A, Priority.RETURNING, FAR)).reason == "queue_full"
    asyncio.run(run())


def test_drained_replica_sends_its_waiters_to_be_rerouted():
    async def run():
        ac = controller(cap=1)
        await ac.admit(A, Priority.FIRST, FAR)
        waiters = [asyncio.create_task(ac.admit(A, Priority.FIRST, FAR)) for _ in range(3)]
        await settle()
        assert ac.drain(A) == 3
        assert all(d.outcome is Outcome.REROUTE for d in await asyncio.gather(*waiters))
        assert ac.queued_total == 0
    asyncio.run(run())


def test_client_leaving_while_queued_or_just_granted_leaks_nothing():
    async def run():
        ac = controller(cap=1)
        await ac.admit(A, Priority.FIRST, FAR)
        left = asyncio.create_task(ac.admit(A, Priority.FIRST, FAR))
        await settle()
        left.cancel()
        await asyncio.gather(left, return_exceptions=True)
        assert ac.queued_total == 0 and ac.in_flight(A) == 1
        granted = asyncio.create_task(ac.admit(A, Priority.FIRST, FAR))
        await settle()
        ac.release(A)  # the slot goes to `granted` ...
        granted.cancel()  # ... whose client leaves before it runs again
        await asyncio.gather(granted, return_exceptions=True)
        assert ac.in_flight(A) == 0 and ac.queued_total == 0
    asyncio.run(run())


def test_random_workload_keeps_the_books():
    async def run():
        rng = random.Random(7)
        ac = AdmissionController({A: 3, B: 2}, queue_size=5, max_wait_s=60.0, retry_after_s=1.0)
        held = {A: 0, B: 0}
        tasks: list[tuple[str, asyncio.Task]] = []
        for _ in range(400):
            op = rng.random()
            replica = rng.choice((A, B))
            if op < 0.5:
                prio = rng.choice(list(Priority))
                tasks.append((replica, asyncio.create_task(ac.admit(replica, prio, FAR))))
            elif op < 0.8 and held[replica]:
                ac.release(replica)
                held[replica] -= 1
            elif tasks:
                _, task = tasks[rng.randrange(len(tasks))]
                task.cancel()
            await settle()
            still = []
            for r, task in tasks:
                if task.done():
                    if not task.cancelled() and task.result().admitted:
                        held[r] += 1
                else:
                    still.append((r, task))
            tasks = still
            for r in (A, B):
                assert ac.in_flight(r) == held[r] <= ac.cap(r)
                assert ac.queued(r) == sum(1 for rr, _ in tasks if rr == r)
            assert ac.queued_total == len(tasks) <= 5
        for _, task in tasks:
            task.cancel()
    asyncio.run(run())
