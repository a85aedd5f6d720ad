"""Prefix caching on full blocks: chained block hashes, longest-prefix match, registration.

A block's hash chains its parent's hash, its own tokens and extra keys (``block.py``). A hit is
re-checked against the stored tokens, parent and keys, so a hash collision never serves foreign
KV. With a host tier, a prefix may continue in the host pool after its device part ends: the
match reports both (``MatchResult``); the host part is loaded before the request's chunk runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chatfleet.engine.block_hash import BlockHash, extend_block_hashes
from chatfleet.engine.kv.block import KVBlock
from chatfleet.engine.kv.block_pool import BlockPool
from chatfleet.errors import KVIntegrityError

__all__ = ["MatchResult", "PrefixCache"]


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix: ``device_tokens`` in ``blocks`` (device pool), then
    ``host_tokens`` more in ``host_blocks`` (host pool), in prefix order."""

    device_tokens: int
    host_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)
    host_blocks: list[KVBlock] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


NO_MATCH = MatchResult(0)


class PrefixCache:
    """Content-addressed reuse of full KV blocks held by a device ``BlockPool`` (and a host one)."""

    def __init__(
        self, pool: BlockPool, block_size: int, *, enabled: bool = True, host_pool: BlockPool | None = None
    ) -> None:
        self.pool = pool
        self.host_pool = host_pool
        self.block_size = block_size
        self.enabled = enabled
        self.queries = 0  # tokens asked for (whole prompts), like vllm:prefix_cache_queries
        self.hits = 0  # tokens served from the device cache, like vllm:prefix_cache_hits
        self.host_queries = 0  # tokens the device cache missed (looked up in the host tier)
        self.host_hits = 0  # tokens of those found in the host tier

    def match(self, token_ids: Sequence[int], *, salt: str | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in whole blocks (the caller caps the length)."""
        if not self.enabled:
            return NO_MATCH
        return self.match_hashes(extend_block_hashes([], token_ids, self.block_size, salt))

    def match_hashes(self, hashes: Sequence[BlockHash], limit: int | None = None) -> MatchResult:
        """Longest prefix of ``hashes[:limit]`` cached on the device, continued in the host pool."""
        if not self.enabled:
            return NO_MATCH
        n = len(hashes) if limit is None else min(limit, len(hashes))
        blocks = self.pool.lookup_run(hashes, 0, n)
        host_blocks: list[KVBlock] = []
        if self.host_pool is not None:
            host_blocks = self.host_pool.lookup_run(hashes, len(blocks), n)
        if not blocks and not host_blocks:
            return NO_MATCH
        bs = self.block_size
        return MatchResult(len(blocks) * bs, len(host_blocks) * bs, blocks, host_blocks)

    def record(self, query_tokens: int, hit_tokens: int, host_hit_tokens: int = 0) -> None:
        self.queries += query_tokens
        self.hits += hit_tokens
        if self.host_pool is not None:
            self.host_queries += query_tokens - hit_tokens
            self.host_hits += host_hit_tokens

    def cache_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Register ``blocks[start:end]`` (full and computed) under ``hashes[start:end]``."""
        if not self.enabled:
            return
        if end > len(hashes) or end > len(blocks):
            raise KVIntegrityError(f"caching blocks up to {end}: {len(hashes)} hashes, {len(blocks)} blocks")
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])

    def reset(self) -> bool:
        """Forget every unreferenced cached block (both tiers); True when the cache is now empty."""
        emptied = self.pool.reset_prefix_cache()
        if self.host_pool is not None:
            emptied = self.host_pool.reset_prefix_cache() and emptied
        return emptied

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
