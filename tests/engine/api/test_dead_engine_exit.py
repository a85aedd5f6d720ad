"""DeadEngineWatch: a server whose engine died stops once, after its grace, and never otherwise."""

from __future__ import annotations

import threading
import time

import pytest

from chatfleet.engine.api.dead_engine_exit import DeadEngineWatch


class FakeEngine:
    def __init__(self) -> None:
        self.dead_error: BaseException | None = None


def test_stops_once_after_the_grace_when_the_engine_dies():
    engine, stopped = FakeEngine(), []
    watch = DeadEngineWatch(engine, stop=lambda: stopped.append(time.monotonic()), grace_s=0.3, poll_s=0.01).start()
    time.sleep(0.1)
    assert stopped == [] and not watch.fired
    died = time.monotonic()
    engine.dead_error = RuntimeError("the core process exited")
    deadline = time.monotonic() + 5
    while not stopped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(stopped) == 1 and watch.fired
    assert stopped[0] - died >= 0.3  # open streams' error events and a probe's 503 get their time
    time.sleep(0.1)
    watch.close()
    assert len(stopped) == 1


def test_a_healthy_engine_is_never_stopped_and_close_ends_the_watch():
    watch = DeadEngineWatch(FakeEngine(), stop=pytest.fail, grace_s=0.0, poll_s=0.01).start()
    time.sleep(0.05)
    watch.close()
    assert not watch.fired
    assert not any(t.name == "chatfleet-dead-engine-watch" for t in threading.enumerate())


def test_closing_during_the_grace_does_not_stop():
    """A server shut down on purpose while its engine winds down exits as asked, not as dead."""
    engine = FakeEngine()
    engine.dead_error = RuntimeError("shutting down")
    watch = DeadEngineWatch(engine, stop=pytest.fail, grace_s=5.0, poll_s=0.01).start()
    time.sleep(0.05)
    t0 = time.monotonic()
    watch.close()
    assert not watch.fired and time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("grace, poll", [(-1.0, 0.1), (1.0, 0.0)])
def test_bad_timings_are_refused(grace, poll):
    with pytest.raises(ValueError):
        DeadEngineWatch(FakeEngine(), stop=lambda: None, grace_s=grace, poll_s=poll)
