"""CPU priority of the worker processes that take hostile work off a server's interpreter.

The engine tokenizes long prompts, and the gateway validates large bodies, in worker processes.
Off the interpreter is not off the CPU: on a machine with few cores, a burst of 1 MB bodies keeps
a worker busy for seconds, and at equal priority the kernel shares a core between it and the
engine's step loop. ``lower_cpu_priority`` (a worker's initializer) makes the worker yield: the
step loop and the event loops run first, and hostile work queues behind them.

Priorities only compare within one scheduling group: Linux groups processes by session
(autogroup) and by cgroup, and shares the CPU equally between groups whatever the priorities
inside. A worker yields to the processes of its own group only, so the servers that must come
first run in one session (``engine.launcher`` keeps its engines in the caller's; a container is
one cgroup).
"""

from __future__ import annotations

import os

WORKER_NICENESS = 10  # added to the server's niceness (0 the default, 19 the lowest priority)


def lower_cpu_priority(niceness: int = WORKER_NICENESS) -> None:
    """Lower the calling process's CPU priority by ``niceness`` (where the system allows it)."""
    try:
        os.nice(niceness)
    except (OSError, AttributeError):  # not permitted, or no os.nice on this platform
        pass
