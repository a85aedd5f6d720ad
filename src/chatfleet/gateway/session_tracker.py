"""Which conversations are in progress: session keys the gateway admitted within a TTL.

A request whose key was admitted less than ``ttl_s`` ago is a *returning* turn: above the caps
it waits before, and is shed after, the first turns of new conversations, so a user in the
middle of a chat keeps service while newcomers get 429 first. A key is recorded when its
request is admitted (a shed newcomer stays new when it retries). At most ``max_sessions`` keys
are kept, least recently admitted dropped first; expiry is lazy.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from chatfleet.errors import ConfigError


class SessionTracker:
    def __init__(self, ttl_s: float, max_sessions: int, clock: Callable[[], float] = time.monotonic) -> None:
        if not ttl_s > 0:
            raise ConfigError(f"session TTL must be > 0 s, got {ttl_s}")
        if max_sessions < 1:
            raise ConfigError(f"max_sessions must be >= 1, got {max_sessions}")
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._last: OrderedDict[str, float] = OrderedDict()  # key -> last admission, oldest first

    def __len__(self) -> int:
        return len(self._last)

    def is_returning(self, key: str | None) -> bool:
        """True if ``key`` was admitted within the TTL (a keyless request is always new)."""
        if key is None:
            return False
        last = self._last.get(key)
        if last is None:
            return False
        if self._clock() - last > self.ttl_s:
            del self._last[key]
            return False
        return True

    def admitted(self, key: str | None) -> None:
        """Record that a request of ``key`` got a slot now."""
        if key is None:
            return
        self._last[key] = self._clock()
        self._last.move_to_end(key)
        self._expire()

    def _expire(self) -> None:
        now = self._clock()
        while self._last:
            key, last = next(iter(self._last.items()))
            if len(self._last) <= self.max_sessions and now - last <= self.ttl_s:
                break
            del self._last[key]
