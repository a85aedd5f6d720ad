"""A short GIL switch interval for the servers' processes.

The engine's step loop runs on a thread beside the event loop, and releases the GIL around
every kernel: each time it wants the GIL back while the event loop thread runs Python (reading a
burst of large bodies, framing replies), it waits until the holder is asked to drop it, which
CPython does after ``sys.getswitchinterval()`` (5 ms by default). A decode step of the tiny
model is a few ms of many short kernels, so behind a busy event loop one step can stretch by
5 ms per kernel. ``shorten_switch_interval`` makes that wait at most ``SERVER_SWITCH_INTERVAL_S``
(``benchmarks/hostile_bodies.py`` measures the effect); the cost is more frequent switches
between threads that both want to run, a few microseconds each.

The gateway's event loop shares its process with the threads of its body-inspection pool (a
feeder thread writing large bodies to the worker's pipe), so it runs with the same interval.
"""

from __future__ import annotations

import sys

SERVER_SWITCH_INTERVAL_S = 0.0001


def shorten_switch_interval(seconds: float = SERVER_SWITCH_INTERVAL_S) -> float:
    """Set the interpreter's switch interval to ``seconds`` where it is longer; the old value."""
    if seconds <= 0:
        raise ValueError("seconds must be > 0")
    previous = sys.getswitchinterval()
    if seconds < previous:
        sys.setswitchinterval(seconds)
    return previous
