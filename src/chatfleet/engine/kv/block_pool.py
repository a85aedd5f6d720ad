"""The paged KV block pool: blocks, reference counts, the free list and the prefix-hash index.

A block is in exactly one of three states:

- free: ``ref_cnt == 0`` and no hash; reused first;
- cached: ``ref_cnt == 0`` with a hash; still findable by the prefix cache, evicted lazily (only
  when a free block is needed and none is left) in the order the eviction policy chooses;
- in use: ``ref_cnt > 0`` (possibly hashed and shared by several requests).

The hash index lives here because eviction must drop index entries; hashing and matching are the
prefix cache's job (``prefix_cache.py``). A cached block is never dropped silently: each eviction
is reported to ``on_evict`` (the KV manager demotes it to the host tier) before the block is
handed out again. The same class serves the device pool and the host pool.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from chatfleet.engine.block_hash import BlockHash
from chatfleet.engine.kv.block import BlockHint, KVBlock
from chatfleet.engine.kv.eviction_policies import make_eviction_policy
from chatfleet.engine.kv.pauses import SessionPauses
from chatfleet.errors import ChatfleetError, KVIntegrityError

__all__ = ["BlockHash", "BlockPool", "Eviction", "KVBlock", "KVIntegrityError"]


@dataclass(frozen=True)
class Eviction:
    """A cached block the pool is about to reuse: its id, the contents' hash, its history."""

    block_id: int
    block_hash: BlockHash
    hint: BlockHint


class BlockPool:
    """``num_blocks`` KV blocks with reference counts, a free list and cached-block eviction."""

    def __init__(
        self,
        num_blocks: int,
        eviction_policy: str = "lru",
        *,
        clock: Callable[[], float] = time.monotonic,
        on_evict: Callable[[Eviction], None] | None = None,
        pauses: SessionPauses | None = None,
    ) -> None:
        if num_blocks < 1:
            raise ChatfleetError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: deque[KVBlock] = deque(self.blocks)
        self._clock = clock
        self._evictable = make_eviction_policy(eviction_policy, clock, pauses)
        self.on_evict = on_evict
        self._index: dict[int, KVBlock] = {}
        self._num_used = 0
        self.num_evictions = 0

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus cached-but-unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks that hold nothing cached (handed out before any cached block is evicted)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a prefix hash (in use or not)."""
        return len(self._index)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request (0..1)."""
        return self._num_used / self.num_blocks

    # ---- allocation ---------------------------------------------------------------------------
    def allocate(self, n: int, session_id: str | None = None) -> list[KVBlock]:
        """Take ``n`` blocks (ref 1 each): free ones first, then evict cached ones (reported to
        ``on_evict`` before the block is handed out)."""
        if n > self.num_free_blocks:
            raise KVIntegrityError(f"asked for {n} blocks, only {self.num_free_blocks} available")
        out = []
        free, on_evict = self._free, self.on_evict
        num_free = min(n, len(free))
        for _ in range(num_free):
            out.append(free.popleft())
        pop = self._evictable.pop
        for _ in range(n - num_free):  # evictions (hot once the pool is full of cached blocks)
            block = pop()
            block_hash = block.block_hash
            assert block_hash is not None
            if on_evict is not None:
                on_evict(Eviction(block.block_id, block_hash, block.hint()))
            self._drop_hash(block)
            out.append(block)
        self.num_evictions += n - num_free
        for block in out:  # new contents: a new usage history, one use (the allocation hot path)
            block.session_id = session_id
            block.last_use = 0.0
            block.num_uses = block.num_sessions = block.ref_cnt = 1
        self._num_used += n
        return out

    def next_evicted(self, n: int) -> list[KVBlock] | None:
        """The cached blocks the next ``n`` evictions would take, in order, where the policy's
        order is its iteration order (``lru``); None where it cannot say."""
        if getattr(self._evictable, "name", None) != "lru":
            return None
        return list(itertools.islice(self._evictable, n))

    def touch(self, blocks: list[KVBlock], session_id: str | None = None) -> None:
        """Add a reference to each block (prefix-cache hits); revives unreferenced cached blocks."""
        remove = self._evictable.remove
        revived = 0
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
                revived += 1
            block.ref_cnt += 1
            block.num_uses += 1  # one use more; a new holder counts as a session change
            if block.num_sessions == 0 or session_id != block.session_id:
                block.num_sessions += 1
                block.session_id = session_id
        self._num_used += revived

    def free(self, blocks: list[KVBlock], *, stamp: bool = True) -> None:
        """Drop one reference from each block, in the given order.

        Callers pass a request's blocks tail first, so a prompt's tail is evicted before its head.
        ``stamp``: record now as the blocks' last use (not for a copy that keeps its history).
        """
        now = self._clock()
        append = self._free.append
        cached: list[KVBlock] = []  # released with contents, in order (to the policy at the end)
        released = 0
        try:
            for block in blocks:
                ref = block.ref_cnt
                if ref <= 0:
                    raise KVIntegrityError(f"freeing {block!r}, which is not in use")
                block.ref_cnt = ref = ref - 1
                if stamp:
                    block.last_use = now
                if not ref:
                    released += 1
                    if block.block_hash is None:
                        append(block)
                    else:
                        cached.append(block)
        finally:
            self._num_used -= released
            self._evictable.add_all(cached)

    # ---- hash index ---------------------------------------------------------------------------
    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full, computed, in-use block under its hash.

        Returns False when another block already holds that hash (the block stays uncached).
        """
        if block.ref_cnt <= 0:
            raise KVIntegrityError(f"caching {block!r}, which is not in use")
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash.value in self._index:
            return False
        block.block_hash = block_hash
        self._index[block_hash.value] = block
        return True

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding exactly ``block_hash`` (value and contents re-checked), if any."""
        block = self._index.get(block_hash.value)
        if block is None or (block.block_hash is not block_hash and block.block_hash != block_hash):
            return None
        return block

    def lookup_run(self, hashes: Sequence[BlockHash], start: int, stop: int) -> list[KVBlock]:
        """The blocks holding ``hashes[start:stop]``, in order, up to the first one not held here
        (``lookup`` of each, in one loop: admission matches hundreds of blocks per request)."""
        get = self._index.get
        out: list[KVBlock] = []
        for i in range(start, stop):
            block_hash = hashes[i]
            block = get(block_hash.value)
            if block is None:
                break
            held = block.block_hash
            if held is not block_hash and held != block_hash:
                break
            out.append(block)
        return out

    def forget(self, block: KVBlock) -> None:
        """Drop an unreferenced cached block's contents now (evictable -> free, unindexed)."""
        if block.ref_cnt != 0 or block.block_hash is None:
            raise KVIntegrityError(f"forgetting {block!r}, which is not an unreferenced cached block")
        self._evictable.remove(block)
        self._drop_hash(block)
        self._free.append(block)

    def reset_prefix_cache(self) -> bool:
        """Drop every unreferenced cached block; True when no hashed block remains."""
        while len(self._evictable):
            block = self._evictable.pop()
            self._drop_hash(block)
            self._free.append(block)
        return not self._index

    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._index[block.block_hash.value]
            block.block_hash = None

    # ---- checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """free + cached + in use == total; states, counts and the hash index agree."""

        def fail(msg: str) -> None:
            raise KVIntegrityError(f"block pool: {msg}")

        free_ids = [b.block_id for b in self._free]
        evictable_ids = [b.block_id for b in self._evictable]
        if len(set(free_ids)) != len(free_ids):
            fail("a block is twice in the free list")
        if len(set(evictable_ids)) != len(evictable_ids):
            fail("a block is twice in the eviction queue")
        if set(free_ids) & set(evictable_ids):
            fail("a block is both free and evictable")
        for b in self._free:
            if b.ref_cnt != 0 or b.block_hash is not None:
                fail(f"{b!r} in the free list must be unreferenced and unhashed")
        for b in self._evictable:
            if b.ref_cnt != 0 or b.block_hash is None:
                fail(f"{b!r} in the eviction queue must be unreferenced and hashed")
        used = [b for b in self.blocks if b.ref_cnt > 0]
        if any(b.ref_cnt < 0 for b in self.blocks):
            fail("negative reference count")
        if len(used) != self._num_used:
            fail(f"{len(used)} blocks referenced but the counter says {self._num_used}")
        if len(free_ids) + len(evictable_ids) + len(used) != self.num_blocks:
            fail(
                f"free {len(free_ids)} + cached {len(evictable_ids)} + in use {len(used)}"
                f" != total {self.num_blocks}"
            )
        hashed = [b for b in self.blocks if b.block_hash is not None]
        if len(hashed) != len(self._index):
            fail(f"{len(hashed)} hashed blocks but {len(self._index)} index entries")
        for value, b in self._index.items():
            if b.block_hash is None or b.block_hash.value != value:
                fail(f"index entry {value} points at {b!r}")
