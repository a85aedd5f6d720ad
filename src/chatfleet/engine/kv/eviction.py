"""Eviction policies: which unreferenced cached block to reuse when no free block is left.

A policy holds the cached blocks nobody references. The pool ``add``s a block (with its
``BlockHint``: session, last use on the injected clock, sharing history) when its last
reference goes, ``remove``s it when a prefix-cache hit revives it, and ``pop``s a victim when
it needs memory. A policy is built with the clock and the engine's ``SessionPauses`` (how long
conversations pause, learned from their turns; ``pauses.py``). The device and the host pool
each have one, built by name from one registry (``eviction_policies.py``;
``CacheConfig.eviction_policy`` / ``host_eviction_policy``):

- ``lru`` (stock): least recently released first.
- ``lfu``: fewest uses first, least recently released among equals.
- ``session``: least expected reuse first (``session_eviction.py``).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

from chatfleet.engine.kv.block import BlockHint, KVBlock
from chatfleet.engine.kv.pauses import SessionPauses
from chatfleet.errors import KVIntegrityError

Clock = Callable[[], float]


class EvictionPolicy(Protocol):
    name: str

    def add(self, block: KVBlock, hint: BlockHint) -> None: ...
    # ``add`` of each, in order, with the hint a policy reads from the block (the pool's free)
    def add_all(self, blocks: list[KVBlock]) -> None: ...
    def remove(self, block: KVBlock) -> None: ...
    def pop(self) -> KVBlock: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[KVBlock]: ...


class LRUEviction:
    """Least recently released first. Blocks of one request are released tail first, so a
    prompt's tail goes before its head (a head is shared by more future requests)."""

    name = "lru"

    def __init__(self, clock: Clock = time.monotonic, pauses: SessionPauses | None = None) -> None:
        self._queue: OrderedDict[int, KVBlock] = OrderedDict()

    def add(self, block: KVBlock, hint: BlockHint | None) -> None:
        self._queue[block.block_id] = block

    def add_all(self, blocks: list[KVBlock]) -> None:  # no hint needed: none is built
        queue = self._queue  # a plain loop: OrderedDict.update of pairs is slower
        for block in blocks:
            queue[block.block_id] = block

    def remove(self, block: KVBlock) -> None:
        del self._queue[block.block_id]

    def pop(self) -> KVBlock:
        return self._queue.popitem(last=False)[1]

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[KVBlock]:
        return iter(self._queue.values())


class LFUEviction:
    """Fewest uses (requests that held the block) first; among equals, least recently released.

    A heap with lazy deletion: ``remove`` forgets the block's entry, ``pop`` skips stale ones.
    """

    name = "lfu"

    def __init__(self, clock: Clock = time.monotonic, pauses: SessionPauses | None = None) -> None:
        self._heap: list[tuple[int, int, KVBlock]] = []
        self._live: dict[int, int] = {}  # block id -> sequence number of its live heap entry
        self._seq = itertools.count()

    def add(self, block: KVBlock, hint: BlockHint) -> None:
        seq = next(self._seq)
        self._live[block.block_id] = seq
        heapq.heappush(self._heap, (hint.num_uses, seq, block))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2].block_id) == e[1]]
            heapq.heapify(self._heap)

    def add_all(self, blocks: list[KVBlock]) -> None:
        for block in blocks:
            self.add(block, block.hint())

    def remove(self, block: KVBlock) -> None:
        del self._live[block.block_id]

    def pop(self) -> KVBlock:
        while self._heap:
            _, seq, block = heapq.heappop(self._heap)
            if self._live.get(block.block_id) == seq:
                del self._live[block.block_id]
                return block
        raise KVIntegrityError("lfu: pop from an empty policy")

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[KVBlock]:
        return (b for _, seq, b in self._heap if self._live.get(b.block_id) == seq)
