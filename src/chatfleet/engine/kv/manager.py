"""The KV manager: each request's block table, allocation as tokens grow, prefix reuse.

``allocate(request, n)`` makes room for ``n`` more tokens after ``request.num_computed_tokens``
and returns the blocks it added, or None ("not now": the scheduler waits or preempts). Blocks of
tokens whose KV is computed are registered in the prefix cache by ``cache_computed``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from chatfleet.engine.kv.block_pool import BlockHash, BlockPool, KVBlock, KVIntegrityError
from chatfleet.engine.kv.prefix_cache import MatchResult, PrefixCache, extend_block_hashes
from chatfleet.engine.request import Request


@dataclass(frozen=True)
class KVBlocks:
    """Blocks added to a request by one ``allocate`` call: prefix hits first, then new ones."""

    block_ids: list[int]
    num_hit_blocks: int = 0

    @property
    def num_new_blocks(self) -> int:
        return len(self.block_ids) - self.num_hit_blocks


@dataclass
class _RequestKV:
    blocks: list[KVBlock] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in (or found in) the cache


class KVManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks, eviction_policy)
        self.prefix_cache = PrefixCache(self.pool, block_size, enabled=enable_prefix_caching)
        self._requests: dict[str, _RequestKV] = {}

    @property
    def total_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        return self.pool.usage

    def uses_prefix_cache(self, request: Request) -> bool:
        return self.prefix_cache.enabled and request.sampling_params.prompt_logprobs is None

    def match_prefix(self, request: Request) -> MatchResult:
        """Cached prefix of a request without KV, leaving at least its last token to compute."""
        if request.request_id in self._requests or not self.uses_prefix_cache(request):
            return MatchResult(0)
        n = (request.num_tokens - 1) // self.block_size * self.block_size
        hashes = extend_block_hashes([], request.all_token_ids[:n], self.block_size, request.cache_salt)
        return self.prefix_cache.match_hashes(hashes)

    def allocate(
        self, request: Request, num_new_tokens: int, *, prefix: MatchResult | None = None
    ) -> KVBlocks | None:
        """Room for ``num_new_tokens`` after the computed ones (plus ``prefix`` hit blocks, for a
        request that has no KV yet). None when the pool cannot supply the blocks now."""
        state = self._requests.get(request.request_id)
        hit_blocks = prefix.blocks if prefix is not None else []
        if hit_blocks and (state is not None or request.num_computed_tokens):
            raise KVIntegrityError(f"prefix hit for {request.request_id!r}, which already has KV")
        num_held = len(state.blocks) if state is not None else 0
        total = request.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        num_needed = -(-total // self.block_size) - num_held - len(hit_blocks)
        num_needed = max(num_needed, 0)
        num_revived = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        if num_needed + num_revived > self.pool.num_free_blocks:
            return None
        if state is None:
            state = self._requests[request.request_id] = _RequestKV()
        if prefix is not None and self.uses_prefix_cache(request):
            self.prefix_cache.record(request.num_tokens, len(hit_blocks) * self.block_size)
        self.pool.touch(hit_blocks)
        new_blocks = self.pool.allocate(num_needed)
        added = hit_blocks + new_blocks
        state.blocks.extend(added)
        added_ids = [b.block_id for b in added]
        state.block_ids.extend(added_ids)
        state.num_cached_blocks += len(hit_blocks)
        return KVBlocks(added_ids, len(hit_blocks))

    def cache_computed(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed."""
        state = self._requests.get(request.request_id)
        if state is None or not self.prefix_cache.enabled:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(state.blocks))
        if num_full <= state.num_cached_blocks:
            return
        if len(state.hashes) < num_full:
            tokens = request.all_token_ids[: num_full * self.block_size]
            extend_block_hashes(state.hashes, tokens, self.block_size, request.cache_salt)
        self.prefix_cache.cache_blocks(state.blocks, state.hashes, state.num_cached_blocks, num_full)
        state.num_cached_blocks = num_full

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (no-op when it holds none)."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self.pool.free(state.blocks[::-1])

    def block_ids(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return list(state.block_ids) if state is not None else []

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
        """Pool invariants, plus: each block's ref count == the number of tables holding it."""
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
