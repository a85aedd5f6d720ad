"""KV manager for models whose layers fall into several groups (sliding window and full attention).

Each layer group (``kv/spec.py``) gets a block pool of its own, sized by the pool plan (the split
between groups is tunable: ``--sliding-memory-fraction``, or ``KVCacheSpec.default_fractions``),
and each request a block table per group. Block hashes are the same in every group (same token
chain, same block size); a group's pool indexes the blocks *it* holds. The interface is
``KVManager``'s (``kv/base.py``), so the scheduler does not know how many groups there are;
per-group tables reach the runner through ``group_block_ids``.

- Full-attention groups keep every block of a running request.
- A sliding-window group keeps only the blocks a request's next queries can see: before a
  chunk at positions ``C..`` runs, blocks wholly before ``C - window + 1`` are released. Their
  table entries become holes (``HOLE``: never read, the windowed attention gathers only the
  window). ``keep_slid_out_blocks`` (default): released blocks stay cached (evictable, findable
  by the next turn); otherwise their hash is dropped and they are plain free blocks.
- Prefix hits follow vLLM's two-step rule for hybrid models: the longest hit in the full groups,
  then the longest point at or before it where every sliding group holds the blocks of its
  window before that point (``window`` tokens, not the whole prefix).

Allocation is all-or-nothing across groups: ``allocate`` returns None, changing nothing but
releasing slid-out blocks (never needed again by that request), when any group is short.
No host tier here (``CacheConfig`` rejects one with several groups).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from chatfleet.engine.block_hash import BlockHash, extend_block_hashes
from chatfleet.engine.kv.base import KVBlocks, KVStats
from chatfleet.engine.kv.block import KVBlock
from chatfleet.engine.kv.block_pool import BlockPool
from chatfleet.engine.kv.pauses import SessionPauses
from chatfleet.engine.kv.prefix_cache import NO_MATCH, MatchResult, PrefixCache
from chatfleet.engine.kv.spec import LayerGroupSpec, PoolPlan
from chatfleet.engine.outputs import KVTransfer
from chatfleet.engine.request import Request
from chatfleet.errors import ConfigError, KVIntegrityError

HOLE = 0  # table entry of a released (or never held) sliding block: a valid index, never read


@dataclass(frozen=True)
class HybridMatch(MatchResult):
    """A two-step prefix hit: ``blocks`` of the first full group (for counting), and per group the
    blocks to take (None where a sliding group needs nothing)."""

    group_blocks: tuple[tuple[KVBlock | None, ...], ...] = ()


@dataclass
class _GroupTable:
    blocks: list[KVBlock | None] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading entries registered in (or found in) the cache


class _Group:
    def __init__(self, spec: LayerGroupSpec, num_blocks: int, eviction_policy: str,
                 clock: Callable[[], float], pauses: SessionPauses) -> None:
        self.spec = spec
        self.window = spec.sliding_window
        self.pool = BlockPool(num_blocks, eviction_policy, clock=clock, pauses=pauses)

    def first_needed(self, position: int) -> int:
        """Index of the first block a query at ``position`` (or later) can see."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // self.spec.block_size


class HybridKVManager:
    def __init__(
        self,
        plan: PoolPlan,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        keep_slid_out_blocks: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        sizes = {p.group.block_size for p in plan.pools}
        if len(sizes) != 1:
            raise ConfigError(f"layer groups with different block sizes {sorted(sizes)} are not supported")
        self.block_size = sizes.pop()
        self.clock = clock
        self.pauses = SessionPauses()
        self.groups = [_Group(p.group, p.num_blocks, eviction_policy, clock, self.pauses) for p in plan.pools]
        full = [g for g in self.groups if g.window is None]
        self._primary = full[0] if full else self.groups[0]
        self.keep_slid_out_blocks = keep_slid_out_blocks
        # Counting (queries/hits) and the enabled flag; lookups go to each group's pool.
        self.prefix_cache = PrefixCache(self._primary.pool, self.block_size, enabled=enable_prefix_caching)
        self._requests: dict[str, list[_GroupTable]] = {}

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self._primary.pool.num_blocks

    @property
    def total_tokens(self) -> int:
        """The longest request the pools can hold (a full group keeps every token)."""
        return self._primary.pool.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Bytes of blocks referenced by requests / bytes of all pools (0..1)."""
        used = sum(g.pool.num_used_blocks * g.spec.bytes_per_block for g in self.groups)
        total = sum(g.pool.num_blocks * g.spec.bytes_per_block for g in self.groups)
        return used / total

    @property
    def has_host_tier(self) -> bool:
        return False

    def stats(self) -> KVStats:
        """Counts summed over every group's pool; ``num_blocks`` is the primary group's."""
        pc = self.prefix_cache
        return KVStats(
            num_blocks=self.num_blocks, block_size=self.block_size, usage=self.usage,
            num_cached_blocks=sum(g.pool.num_cached_blocks for g in self.groups),
            num_evictions=sum(g.pool.num_evictions for g in self.groups),
            prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
        )

    def min_blocks(self, max_batched_tokens: int) -> dict[str, int]:
        """Blocks each sliding group needs so that one request can always run alone: a chunk of
        ``max_batched_tokens`` is written whole, plus the window before it."""
        return {g.spec.name: -(-(max_batched_tokens + g.window - 1) // self.block_size) + 1
                for g in self.groups if g.window is not None}

    def max_step_tokens(self) -> int:
        """The largest per-step token budget every sliding pool can serve alone (a chunk is
        written whole, plus the window before it); ConfigError when not even one token fits."""
        fit = min(((g.pool.num_blocks - 1) * self.block_size - g.window + 1 for g in self.groups
                   if g.window is not None), default=1 << 30)
        if fit < 1:
            g = min((g for g in self.groups if g.window is not None), key=lambda g: g.pool.num_blocks)
            raise ConfigError(f"the {g.spec.name} KV pool ({g.pool.num_blocks} blocks) cannot hold one window of"
                              f" {g.window} tokens: give it a larger memory fraction (--sliding-memory-fraction)")
        return fit

    # ---- prefix matching -----------------------------------------------------------------------
    def uses_prefix_cache(self, request: Request) -> bool:
        return self.prefix_cache.enabled and request.sampling_params.prompt_logprobs is None

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            extend_block_hashes(hashes, request.all_token_ids[: num_blocks * self.block_size], self.block_size,
                                request.cache_salt)
        return hashes

    def match_prefix(self, request: Request) -> MatchResult:
        """Two-step hit of a request without KV, leaving at least its last token to compute."""
        if request.request_id in self._requests or not self.uses_prefix_cache(request):
            return NO_MATCH
        n = (request.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(request, n)[:n]
        k = n
        for g in self.groups:  # step 1: the longest hit every full group has
            if g.window is None:
                k = len(g.pool.lookup_run(hashes, 0, k))
        sliding = [g for g in self.groups if g.window is not None]
        present = {id(g): [g.pool.lookup(hashes[j]) is not None for j in range(k)] for g in sliding}
        while k > 0 and not all(all(present[id(g)][g.first_needed(k * self.block_size):k]) for g in sliding):
            k -= 1  # step 2: back off until each sliding group holds its window before the hit
        if k == 0:
            return NO_MATCH
        per_group = tuple(
            tuple(g.pool.lookup(hashes[j]) if j >= g.first_needed(k * self.block_size) else None
                  for j in range(k))
            for g in self.groups
        )
        primary = per_group[self.groups.index(self._primary)]
        return HybridMatch(k * self.block_size, 0, [b for b in primary if b is not None], [], per_group)

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, *, prefix: MatchResult | None = None
                 ) -> KVBlocks | None:
        """Room for ``num_new_tokens`` after the computed ones in every group (plus a prefix hit's
        blocks, for a request without KV). None, changing nothing else, when a group is short."""
        rid = request.request_id
        tables = self._requests.get(rid)
        hit = prefix if isinstance(prefix, HybridMatch) and prefix.num_tokens else None
        if hit is not None and (tables is not None or request.num_computed_tokens):
            raise KVIntegrityError(f"prefix hit for {rid!r}, which already has KV")
        if prefix is not None and prefix.num_tokens and hit is None:
            raise KVIntegrityError(f"{rid!r}: a prefix match not made by this manager")
        start = request.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        end_block = -(-(start + num_new_tokens) // self.block_size)
        if tables is not None:
            self._release_slid_out(tables, start)
        plans: list[tuple[list[KVBlock], int]] = []  # per group: hit blocks to take, new blocks to make
        for i, g in enumerate(self.groups):
            held = len(tables[i].blocks) if tables is not None else 0
            hits = [b for b in hit.group_blocks[i] if b is not None] if hit is not None else []
            if hit is not None:
                held = len(hit.group_blocks[i])
            first_new = max(held, g.first_needed(start))
            num_new = max(0, end_block - first_new)
            revived = sum(1 for b in hits if b.ref_cnt == 0)
            if num_new + revived > g.pool.num_free_blocks:
                return None
            if any(b.block_hash is None for b in hits):
                raise KVIntegrityError(f"{rid!r}: a matched block was evicted before allocation")
            plans.append((hits, num_new))
        session = request.session_id
        if tables is None:
            tables = self._requests[rid] = [_GroupTable() for _ in self.groups]
            if session is not None and request.num_preemptions == 0:
                self.pauses.note_turn(session, self.clock())
        if prefix is not None and self.uses_prefix_cache(request):
            self.prefix_cache.record(request.num_tokens, hit.num_tokens if hit is not None else 0)
        added: list[int] = []
        for i, (g, table, (hits, num_new)) in enumerate(zip(self.groups, tables, plans, strict=True)):
            if hit is not None:
                g.pool.touch(hits, session)
                table.blocks.extend(hit.group_blocks[i])
                table.num_cached_blocks = len(table.blocks)
            holes = max(0, g.first_needed(start) - len(table.blocks))
            table.blocks.extend([None] * holes)  # a window starting past what is held
            new = g.pool.allocate(num_new, session)
            table.blocks.extend(new)
            if g is self._primary:
                added = [b.block_id for b in hits + new]
        return KVBlocks(added, len(plans[self.groups.index(self._primary)][0]))

    def new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """The most new blocks ``allocate(request, num_new_tokens)`` takes from any one group's
        pool, for a request holding KV (blocks it releases from a window first are not counted)."""
        tables = self._requests.get(request.request_id)
        start = request.num_computed_tokens
        end_block = -(-(start + num_new_tokens) // self.block_size)
        most = 0
        for i, g in enumerate(self.groups):
            held = len(tables[i].blocks) if tables is not None else 0
            most = max(most, end_block - max(held, g.first_needed(start)))
        return most

    def free_blocks_needed(self, request: Request, num_new_tokens: int, prefix: MatchResult) -> int:
        """The most free blocks ``allocate(request, num_new_tokens, prefix=prefix)`` takes from any
        one group's pool for a request without KV (new blocks plus revived cached hits)."""
        hit = prefix if isinstance(prefix, HybridMatch) and prefix.num_tokens else None
        start = request.num_computed_tokens + (hit.num_tokens if hit is not None else 0)
        end_block = -(-(start + num_new_tokens) // self.block_size)
        most = 0
        for i, g in enumerate(self.groups):
            held, revived = 0, 0
            if hit is not None:
                held = len(hit.group_blocks[i])
                revived = sum(1 for b in hit.group_blocks[i] if b is not None and b.ref_cnt == 0)
            most = max(most, max(0, end_block - max(held, g.first_needed(start))) + revived)
        return most

    def _release_slid_out(self, tables: list[_GroupTable], position: int) -> None:
        """Release each sliding group's blocks that no query at ``position`` or later can see."""
        for g, table in zip(self.groups, tables, strict=True):
            if g.window is None:
                continue
            first = min(g.first_needed(position), len(table.blocks))
            gone = [b for b in table.blocks[:first] if b is not None]
            if not gone:
                continue
            for j in range(first):
                table.blocks[j] = None
            self._free_blocks(g, gone[::-1], slid_out=True)

    def _free_blocks(self, g: _Group, blocks: list[KVBlock], slid_out: bool = False) -> None:
        g.pool.free(blocks)
        if slid_out and not self.keep_slid_out_blocks:
            for b in blocks:  # drop the contents of slid-out blocks nobody else holds
                if b.ref_cnt == 0 and b.block_hash is not None:
                    g.pool.forget(b)

    def cache_computed(self, request: Request) -> None:
        """Register each group's full, computed blocks (holes are skipped: they were registered
        before they slid out, or belonged to an earlier request)."""
        tables = self._requests.get(request.request_id)
        if tables is None or not self.prefix_cache.enabled:
            return
        num_full = request.num_computed_tokens // self.block_size
        hashes: list[BlockHash] | None = None
        for g, table in zip(self.groups, tables, strict=True):
            end = min(num_full, len(table.blocks))
            if end <= table.num_cached_blocks:
                continue
            hashes = hashes or self.block_hashes(request, num_full)
            for j in range(table.num_cached_blocks, end):
                b = table.blocks[j]
                if b is not None:
                    g.pool.cache_block(b, hashes[j])
            table.num_cached_blocks = end

    def free(self, request_id: str) -> None:
        """Release every block of the request in every group, tail first."""
        tables = self._requests.pop(request_id, None)
        if tables is None:
            return
        for g, table in zip(self.groups, tables, strict=True):
            self._free_blocks(g, [b for b in table.blocks[::-1] if b is not None])

    # ---- tiers (none) --------------------------------------------------------------------------
    def take_transfers(self) -> list[KVTransfer]:
        return []

    def finish_transfers(self) -> None:
        pass

    # ---- views ---------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The primary (full-attention) group's table."""
        return self.group_block_ids(request_id).get(self._primary.spec.name, [])

    def group_block_ids(self, request_id: str) -> dict[str, list[int]]:
        tables = self._requests.get(request_id)
        if tables is None:
            return {}
        return {g.spec.name: [b.block_id if b is not None else HOLE for b in t.blocks]
                for g, t in zip(self.groups, tables, strict=True)}

    def num_blocks_of(self, request_id: str) -> int:
        tables = self._requests.get(request_id)
        return min(len(t.blocks) for t in tables) if tables is not None else 0

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def reset_prefix_cache(self) -> bool:
        emptied = True
        for g in self.groups:
            emptied = g.pool.reset_prefix_cache() and emptied
        return emptied

    def check_integrity(self) -> None:
        """Every pool's invariants; each block's ref count == the tables holding it; a sliding
        table's live blocks are one run at its end (holes only before the window)."""
        for i, g in enumerate(self.groups):
            g.pool.check_integrity()
            refs: Counter[int] = Counter()
            for rid, tables in self._requests.items():
                table = tables[i]
                live = [j for j, b in enumerate(table.blocks) if b is not None]
                ids = [table.blocks[j].block_id for j in live]  # type: ignore[union-attr]
                if len(set(ids)) != len(ids):
                    raise KVIntegrityError(f"request {rid!r} holds a {g.spec.name} block twice: {ids}")
                if g.window is None and len(live) != len(table.blocks):
                    raise KVIntegrityError(f"request {rid!r}: a hole in full-attention group {g.spec.name}")
                if live and live != list(range(live[0], len(table.blocks))):
                    raise KVIntegrityError(f"request {rid!r}: {g.spec.name} blocks are not one run at the end")
                if table.num_cached_blocks > len(table.blocks):
                    raise KVIntegrityError(f"request {rid!r}: more cached blocks than blocks in {g.spec.name}")
                refs.update(ids)
            for block in g.pool.blocks:
                if block.ref_cnt != refs.get(block.block_id, 0):
                    raise KVIntegrityError(f"{g.spec.name} {block!r} is held by {refs.get(block.block_id, 0)} requests")
        lengths = {rid: {len(t.blocks) for t in tables} for rid, tables in self._requests.items()}
        for rid, lens in lengths.items():
            if len(lens) != 1:
                raise KVIntegrityError(f"request {rid!r}: group tables of different lengths {sorted(lens)}")
