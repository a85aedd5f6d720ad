"""The single-pool KV manager (``PagedKVManager``, a ``KVManager``: ``kv/base.py``): each
request's block table, allocation as tokens grow, prefix reuse, an optional host tier.

``allocate(request, n)`` makes room for ``n`` more tokens after ``request.num_computed_tokens``
and returns the blocks it added, or None ("not now": the scheduler waits or preempts). Blocks of
tokens whose KV is computed are registered in the prefix cache by ``cache_computed``.

A request's block hashes are computed once and extended as it grows (kept on the request, so a
waiting request re-matched every step hashes nothing new). With a host tier, device evictions
demote blocks to host memory and prefix hits there are promoted: both become ``KVTransfer``s
that the scheduler puts in its plan (``take_transfers``) and releases after it ran
(``finish_transfers``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from chatfleet.engine.block_hash import BlockHash, extend_block_hashes
from chatfleet.engine.kv.base import KVBlocks, KVStats
from chatfleet.engine.kv.block import KVBlock
from chatfleet.engine.kv.block_pool import BlockPool, Eviction
from chatfleet.engine.kv.host_tier import HostTier
from chatfleet.engine.kv.pauses import SessionPauses
from chatfleet.engine.kv.prefix_cache import NO_MATCH, MatchResult, PrefixCache
from chatfleet.engine.outputs import KVTransfer
from chatfleet.engine.request import Request
from chatfleet.errors import KVIntegrityError

__all__ = ["KVBlocks", "PagedKVManager"]

_block_hash = attrgetter("block_hash")
_ref_cnt = attrgetter("ref_cnt")


def _num_unreferenced(blocks: list[KVBlock]) -> int:
    """Cached blocks a prefix hit revives (in C: a hit has hundreds of blocks)."""
    return list(map(_ref_cnt, blocks)).count(0)


_NOTHING_ADDED = KVBlocks([])  # a growing request's usual answer (its last block has room); shared, read-only


@dataclass(slots=True)
class _RequestKV:
    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in (or found in) the cache


class PagedKVManager:
    """One device block pool (and a host pool behind it) shared by every layer: one table per request."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        num_host_blocks: int = 0,
        host_eviction_policy: str = "lru",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.clock = clock
        self.pauses = SessionPauses()  # shared by both pools' eviction policies
        tiered = num_host_blocks > 0 and enable_prefix_caching
        self.pool = BlockPool(num_blocks, eviction_policy, clock=clock,
                              on_evict=self._on_device_evict if tiered else None, pauses=self.pauses)
        self.host: HostTier | None = None
        if tiered:
            self.host = HostTier(BlockPool(num_host_blocks, host_eviction_policy, clock=clock, pauses=self.pauses))
        self.prefix_cache = PrefixCache(
            self.pool, block_size, enabled=enable_prefix_caching,
            host_pool=self.host.pool if self.host is not None else None,
        )
        self._requests: dict[str, _RequestKV] = {}

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def host_pool(self) -> BlockPool | None:
        return self.host.pool if self.host is not None else None

    @property
    def has_host_tier(self) -> bool:
        return self.host is not None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now: empty ones, then evictable cached ones."""
        return self.pool.num_free_blocks

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks holding no cached contents (taking them evicts nothing)."""
        return self.pool.num_empty_blocks

    def next_evicted(self, n: int) -> list[KVBlock] | None:
        """The cached blocks the next ``n`` evictions would take, in order (None where the
        eviction policy cannot tell)."""
        return self.pool.next_evicted(n)

    def stats(self) -> KVStats:
        pc, host = self.prefix_cache, self.host
        return KVStats(
            num_blocks=self.num_blocks, block_size=self.block_size, usage=self.pool.usage,
            num_cached_blocks=self.pool.num_cached_blocks, num_evictions=self.pool.num_evictions,
            prefix_cache_queries=pc.queries, prefix_cache_hits=pc.hits,
            host=host.stats() if host is not None else None,
            host_cache_queries=pc.host_queries, host_cache_hits=pc.host_hits,
        )

    def uses_prefix_cache(self, request: Request) -> bool:
        return self.prefix_cache.enabled and request.sampling_params.prompt_logprobs is None

    def block_hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The request's hashes of at least its first ``num_blocks`` full blocks (cached on it)."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:  # only the tokens of the blocks still to hash
            bs = self.block_size
            start, end = len(hashes) * bs, num_blocks * bs
            prompt, p = request.prompt_token_ids, request.num_prompt_tokens
            if end <= p:
                tokens = prompt[start:end]
            elif start >= p:
                tokens = request.output_token_ids[start - p : end - p]
            else:
                tokens = prompt[start:] + request.output_token_ids[: end - p]
            extend_block_hashes(hashes, tokens, bs, request.cache_salt, first_block=len(hashes))
        return hashes

    def match_prefix(self, request: Request) -> MatchResult:
        """Cached prefix of a request without KV, leaving at least its last token to compute."""
        if request.request_id in self._requests or not self.uses_prefix_cache(request):
            return NO_MATCH
        n = (request.num_tokens - 1) // self.block_size
        return self.prefix_cache.match_hashes(self.block_hashes(request, n), n)

    def allocate(
        self, request: Request, num_new_tokens: int, *, prefix: MatchResult | None = None
    ) -> KVBlocks | None:
        """Room for ``num_new_tokens`` after the computed ones (plus ``prefix`` hit blocks, for a
        request that has no KV yet; host hits are loaded into the first new blocks). None when
        the pool cannot supply the blocks now."""
        state = self._requests.get(request.request_id)
        if prefix is None and state is not None:  # the hot path: a running request grows
            total = request.num_computed_tokens + num_new_tokens
            num_needed = -(-total // self.block_size) - len(state.blocks)
            if num_needed <= 0:
                return _NOTHING_ADDED
            if num_needed > self.pool.num_free_blocks:
                return None
            new_blocks = self.pool.allocate(num_needed, request.session_id)
            state.blocks.extend(new_blocks)
            added_ids = [b.block_id for b in new_blocks]
            state.block_ids.extend(added_ids)
            return KVBlocks(added_ids)
        hit_blocks = prefix.blocks if prefix is not None else []
        host_blocks = prefix.host_blocks if prefix is not None else []
        if (hit_blocks or host_blocks) and (state is not None or request.num_computed_tokens):
            raise KVIntegrityError(f"prefix hit for {request.request_id!r}, which already has KV")
        num_held = len(state.blocks) if state is not None else 0
        num_hit = len(hit_blocks)
        num_needed = self._num_new_blocks(request, num_new_tokens, num_hit, len(host_blocks), num_held)
        num_revived = _num_unreferenced(hit_blocks)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        if not all(map(_block_hash, hit_blocks)) or not all(map(_block_hash, host_blocks)):  # a hash is truthy
            raise KVIntegrityError(f"{request.request_id!r}: a matched block was evicted before allocation")
        session = request.session_id
        if state is None:
            state = self._requests[request.request_id] = _RequestKV()
            if session is not None and request.num_preemptions == 0:
                self.pauses.note_turn(session, self.clock())
        if prefix is not None and self.uses_prefix_cache(request):
            self.prefix_cache.record(request.num_tokens, num_hit * self.block_size,
                                     len(host_blocks) * self.block_size)
        if host_blocks:
            assert self.host is not None
            self.host.pin(host_blocks, session)  # before allocating: demotions may evict host blocks
        self.pool.touch(hit_blocks, session)
        new_blocks = self.pool.allocate(num_needed, session)
        if host_blocks:
            assert self.host is not None
            self.host.promote(host_blocks, new_blocks, session)
        added = hit_blocks + new_blocks
        state.blocks.extend(added)
        added_ids = [b.block_id for b in added]
        state.block_ids.extend(added_ids)
        state.num_cached_blocks += num_hit
        return KVBlocks(added_ids, num_hit, len(host_blocks))

    def _num_new_blocks(self, request: Request, num_new_tokens: int, num_hit: int, num_host: int,
                        num_held: int) -> int:
        total = request.num_computed_tokens + (num_hit + num_host) * self.block_size + num_new_tokens
        return max(-(-total // self.block_size) - num_held - num_hit, 0)

    def new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks ``allocate(request, num_new_tokens)`` takes from the pool for a request that
        holds KV already (a growing one)."""
        state = self._requests.get(request.request_id)
        held = len(state.blocks) if state is not None else 0
        return max(-(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - held, 0)

    def free_blocks_needed(self, request: Request, num_new_tokens: int, prefix: MatchResult) -> int:
        """Free blocks ``allocate(request, num_new_tokens, prefix=prefix)`` would take for a
        request without KV (new blocks plus revived cached hits); it returns None when the pool
        has fewer free blocks than this."""
        hit_blocks = prefix.blocks
        return (self._num_new_blocks(request, num_new_tokens, len(hit_blocks), len(prefix.host_blocks), 0)
                + _num_unreferenced(hit_blocks))

    def cache_computed(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed."""
        state = self._requests.get(request.request_id)
        if state is None or not self.prefix_cache.enabled:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(state.blocks))
        if num_full <= state.num_cached_blocks:
            return
        hashes = self.block_hashes(request, num_full)
        self.prefix_cache.cache_blocks(state.blocks, hashes, state.num_cached_blocks, num_full)
        state.num_cached_blocks = num_full

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (no-op when it holds none)."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.pool.free(state.blocks[::-1])

    # ---- tiers ---------------------------------------------------------------------------------
    def _on_device_evict(self, eviction: Eviction) -> None:
        if self.host is not None:
            self.host.demote(eviction)

    def take_transfers(self) -> list[KVTransfer]:
        return self.host.take_transfers() if self.host is not None else []

    def finish_transfers(self) -> None:
        if self.host is not None:
            self.host.finish_transfers()

    # ---- views ---------------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return list(state.block_ids) if state is not None else []

    def group_block_ids(self, request_id: str) -> dict[str, list[int]] | None:
        """None: one table (``block_ids``) serves every layer group (see ``kv/hybrid.py``)."""
        return None

    def num_blocks_of(self, request_id: str) -> int:
        state = self._requests.get(request_id)
        return len(state.blocks) if state is not None else 0

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def reset_prefix_cache(self) -> bool:
        return self.prefix_cache.reset()

    def check_integrity(self) -> None:
        """Both pools' invariants, plus: each device block's ref count == the number of tables
        holding it, and each host block's == the transfers in flight naming it."""
        self.pool.check_integrity()
        refs: Counter[int] = Counter()
        for rid, state in self._requests.items():
            ids = [b.block_id for b in state.blocks]
            if ids != state.block_ids:
                raise KVIntegrityError(f"request {rid!r}: block id list out of sync with its blocks")
            if len(set(ids)) != len(ids):
                raise KVIntegrityError(f"request {rid!r} holds a block twice: {ids}")
            refs.update(ids)
            if state.num_cached_blocks > len(state.blocks):
                raise KVIntegrityError(f"request {rid!r}: more cached blocks than blocks")
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise KVIntegrityError(
                    f"{block!r} is held by {refs.get(block.block_id, 0)} requests"
                )
        if self.host is not None:
            self.host.check_integrity()
