"""Routing policies: which replica a request goes to.

The default, ``bounded_load``, is consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam, 2018): every replica owns many points on a hash ring; a session goes to the first
replica clockwise from its key that is healthy and whose load is under
``ceil(c * (total load + 1) / healthy replicas)``; a replica at its admission cap counts as
over its bound while another has a free slot. Hashes come from hashlib, so every gateway
process with the same replica list builds the same ring and places a session the same way without
shared state. A session's *home* is the first replica clockwise among all replicas; serving it
anywhere else breaks its affinity (its KV cache is on the home replica).
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import itertools
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from chatfleet.errors import ConfigError


class Affinity(str, enum.Enum):
    KEPT = "kept"  # served by its home replica
    BROKEN = "broken"  # home replica down, full, or over its load bound
    NONE = "none"  # the request has no session key


@dataclass(frozen=True)
class RoutingDecision:
    replica: str
    home: str | None
    affinity: Affinity
    reason: str  # "home", "over_bound", "home_full", "home_down", "no_key", "least_loaded"


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


class HashRing:
    """Replicas placed on a 64-bit ring at ``virtual_nodes`` points each.

    A pure function of the replica set: the same nodes, in any order, make the same ring (an
    empty ring, while discovery has found no replica yet, prefers nobody).
    """

    def __init__(self, nodes: Sequence[str], virtual_nodes: int = 160) -> None:
        points = sorted((ring_hash(f"{node}#{i}"), node) for node in nodes for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._nodes = [n for _, n in points]
        self.nodes = tuple(sorted(set(nodes)))

    def preference(self, key: str) -> Iterator[str]:
        """Distinct replicas in clockwise order from the key's point."""
        if not self._nodes:
            return
        start = bisect.bisect(self._hashes, ring_hash(key))
        seen: set[str] = set()
        total = len(self._nodes)
        for i in range(total):
            node = self._nodes[(start + i) % total]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.nodes):
                    return

    def home(self, key: str) -> str:
        return next(self.preference(key))


class RoutingPolicy(Protocol):
    name: str

    def route(self, key: str | None, candidates: Sequence[str], loads: Mapping[str, int],
              full: Collection[str] = ()) -> RoutingDecision:
        """Pick one of ``candidates`` (healthy, not yet tried; never empty).

        ``full`` candidates (at their admission cap) are passed over while any other is open.
        """


class _RingPolicy:
    name = "consistent_hash"

    def __init__(self, replicas: Sequence[str], virtual_nodes: int, load_factor: float) -> None:
        self.ring = HashRing(replicas, virtual_nodes)
        self.load_factor = load_factor
        self._rr = itertools.count()

    def bound(self, candidates: Sequence[str], loads: Mapping[str, int]) -> float:
        return math.inf

    def route(self, key: str | None, candidates: Sequence[str], loads: Mapping[str, int],
              full: Collection[str] = ()) -> RoutingDecision:
        open_ = [c for c in candidates if c not in full] or list(candidates)
        if key is None:
            return _least_loaded(open_, loads, self._rr, reason="no_key")
        allowed = set(open_)
        bound = self.bound(candidates, loads)
        home: str | None = None
        for replica in self.ring.preference(key):
            home = home or replica
            if replica in allowed and loads.get(replica, 0) < bound:
                if replica == home:
                    return RoutingDecision(replica, home, Affinity.KEPT, "home")
                reason = ("home_down" if home not in candidates else
                          "home_full" if home not in allowed else "over_bound")
                return RoutingDecision(replica, home, Affinity.BROKEN, reason)
        # Unreachable while some candidate is on the ring and under the bound; be safe anyway.
        return _least_loaded(open_, loads, self._rr, reason="over_bound", home=home)


class BoundedLoadPolicy(_RingPolicy):
    name = "bounded_load"

    def bound(self, candidates: Sequence[str], loads: Mapping[str, int]) -> float:
        total = sum(loads.get(c, 0) for c in candidates)
        return math.ceil(self.load_factor * (total + 1) / len(candidates))


class LeastLoadedPolicy:
    """No affinity: the least loaded candidate, ties broken round-robin."""

    name = "least_loaded"

    def __init__(self, replicas: Sequence[str], virtual_nodes: int, load_factor: float) -> None:
        self._rr = itertools.count()

    def route(self, key: str | None, candidates: Sequence[str], loads: Mapping[str, int],
              full: Collection[str] = ()) -> RoutingDecision:
        open_ = [c for c in candidates if c not in full] or list(candidates)
        return _least_loaded(open_, loads, self._rr, reason="least_loaded")


def _least_loaded(candidates: Sequence[str], loads: Mapping[str, int], rr: Iterator[int], *,
                  reason: str, home: str | None = None) -> RoutingDecision:
    low = min(loads.get(c, 0) for c in candidates)
    ties = [c for c in candidates if loads.get(c, 0) == low]
    replica = ties[next(rr) % len(ties)]
    affinity = Affinity.NONE if home is None else Affinity.BROKEN
    return RoutingDecision(replica, home, affinity, reason)


# name -> constructor (replicas, virtual_nodes, load_factor)
ROUTING_POLICIES: dict[str, Callable[[Sequence[str], int, float], RoutingPolicy]] = {
    BoundedLoadPolicy.name: BoundedLoadPolicy,
    _RingPolicy.name: _RingPolicy,
    LeastLoadedPolicy.name: LeastLoadedPolicy,
}


def make_routing_policy(name: str, replicas: Sequence[str], *, virtual_nodes: int = 160,
                        load_factor: float = 1.25) -> RoutingPolicy:
    try:
        cls = ROUTING_POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown routing policy {name!r}; valid: {sorted(ROUTING_POLICIES)}") from None
    return cls(replicas, virtual_nodes, load_factor)
