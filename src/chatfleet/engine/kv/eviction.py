"""Eviction policies: which unreferenced cached block to reuse when no free block is left.

A policy holds the cached blocks nobody references. The pool ``add``s a block when its last
reference goes, ``remove``s it when a prefix-cache hit revives it, and ``pop``s a victim when it
needs memory. Policies are registered by name (``CacheConfig.eviction_policy``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, Protocol

from chatfleet.errors import ConfigError

if TYPE_CHECKING:
    from chatfleet.engine.kv.block_pool import KVBlock


class EvictionPolicy(Protocol):
    name: str

    def add(self, block: KVBlock) -> None: ...
    def remove(self, block: KVBlock) -> None: ...
    def pop(self) -> KVBlock: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[KVBlock]: ...


class LRUEviction:
    """Least recently released first. Blocks of one request are released tail first, so a
    prompt's tail goes before its head (a head is shared by more future requests)."""

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, KVBlock] = OrderedDict()

    def add(self, block: KVBlock) -> None:
        self._queue[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def pop(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(self._queue.values())


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUEviction,
}


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        valid = ", ".join(sorted(EVICTION_POLICIES))
        raise ConfigError(f"unknown eviction policy {name!r}; valid: {valid}") from None
