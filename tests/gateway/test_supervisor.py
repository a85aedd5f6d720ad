"""The replica supervisor: exits are noticed, restarts wait out a doubling backoff that resets
once a replica has stayed up, and the states say so."""

from __future__ import annotations

from chatfleet.gateway.supervisor import BackoffPolicy, ReplicaSupervisor


class Proc:
    pids = iter(range(100, 1000))

    def __init__(self) -> None:
        self.pid = next(Proc.pids)
        self.returncode = None

    def poll(self):
        return self.returncode


class FakeFleet:
    def __init__(self, n: int) -> None:
        self.urls = [f"http://127.0.0.1:{9000 + i}" for i in range(n)]
        self.processes = [Proc() for _ in range(n)]
        self.fail_next = False

    def restart(self, index: int, die_with_thread: bool = False) -> Proc:
        if self.fail_next:
            self.fail_next = False
            raise OSError("address already in use")
        self.processes[index] = Proc()
        return self.processes[index]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_dead_replica_restarts_after_a_doubling_backoff_that_resets_when_stable():
    fleet, clock = FakeFleet(2), Clock()
    sup = ReplicaSupervisor(fleet, BackoffPolicy(min_backoff_s=1, max_backoff_s=4, stable_s=50), clock=clock)
    a, b = fleet.urls
    fleet.processes[0].returncode = -9
    sup.poll()
    state = sup.states()[a]
    assert not state.running and state.last_exit_code == -9 and state.next_restart_in_s == 1
    assert sup.states()[b].running
    clock.now = 0.5
    sup.poll()
    assert not sup.states()[a].running  # still backing off
    clock.now = 1.0
    sup.poll()
    state = sup.states()[a]
    assert state.running and state.restarts == 1 and state.pid == fleet.processes[0].pid
    delays = []
    for _ in range(3):  # dies again at once: 2 s, then 4 s (the cap), then 4 s
        fleet.processes[0].returncode = 1
        sup.poll()
        delays.append(sup.states()[a].next_restart_in_s)
        clock.now += delays[-1]
        sup.poll()
    assert delays == [2, 4, 4] and sup.states()[a].restarts == 4
    clock.now += 50  # stable for a while: the backoff starts over
    sup.poll()
    fleet.processes[0].returncode = 1
    sup.poll()
    assert sup.states()[a].next_restart_in_s == 1


def test_a_failed_restart_is_retried_later_and_reported():
    fleet, clock = FakeFleet(1), Clock()
    sup = ReplicaSupervisor(fleet, BackoffPolicy(min_backoff_s=1, max_backoff_s=8), clock=clock)
    (url,) = fleet.urls
    fleet.processes[0].returncode = 1
    sup.poll()
    fleet.fail_next = True
    clock.now = 1
    sup.poll()
    state = sup.states()[url]
    assert not state.running and "already in use" in state.last_error and state.next_restart_in_s == 2
    clock.now = 3
    sup.poll()
    assert sup.states()[url].running and sup.states()[url].last_error is None
