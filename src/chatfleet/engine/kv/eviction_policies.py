"""The eviction policies by name, registered in one place: ``lru`` and ``lfu``
(``eviction.py``) and ``session`` (``session_eviction.py``). ``make_eviction_policy`` builds one
with the pool's clock and the engine's ``SessionPauses``; an unknown name is a ``ConfigError``
that lists the valid ones."""

from __future__ import annotations

import time

from chatfleet.engine.kv.eviction import Clock, EvictionPolicy, LFUEviction, LRUEviction
from chatfleet.engine.kv.pauses import SessionPauses
from chatfleet.engine.kv.session_eviction import SessionEviction
from chatfleet.registry import Registry

EVICTION_POLICIES: Registry[EvictionPolicy] = Registry("eviction policy")
EVICTION_POLICIES.register("lru")(LRUEviction)
EVICTION_POLICIES.register("lfu")(LFUEviction)
EVICTION_POLICIES.register("session")(SessionEviction)


def make_eviction_policy(name: str, clock: Clock = time.monotonic,
                         pauses: SessionPauses | None = None) -> EvictionPolicy:
    return EVICTION_POLICIES.make(name, clock=clock, pauses=pauses)
