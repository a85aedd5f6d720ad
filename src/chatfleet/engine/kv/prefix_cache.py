"""Prefix caching on full blocks: chained block hashes, longest-prefix match, registration.

A block's hash chains its parent's hash, its own tokens and extra keys (a tenant's cache salt,
given to the first block, reaches every later block through the chain). A hit is re-checked
against the stored tokens, parent and keys, so a hash collision never serves foreign KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chatfleet.engine.kv.block_pool import BlockHash, BlockPool, KVBlock, KVIntegrityError


@dataclass(frozen=True)
class MatchResult:
    """The longest cached prefix: tokens found on the device (and, later, in host memory)."""

    device_tokens: int
    host_tokens: int = 0
    blocks: list[KVBlock] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> BlockHash:
    parent_value = None if parent is None else parent.value
    tokens = tuple(token_ids)
    return BlockHash(hash((parent_value, tokens, extra_keys)), parent_value, tokens, extra_keys)


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: str | None = None
) -> list[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``hashes`` (in place)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra = (salt,) if (i == 0 and salt is not None) else ()
        hashes.append(hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra))
    return hashes


class PrefixCache:
    """Content-addressed reuse of full KV blocks held by a ``BlockPool``."""

    def __init__(self, pool: BlockPool, block_size: int, *, enabled: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.queries = 0  # tokens asked for (whole prompts), like vllm:prefix_cache_queries
        self.hits = 0  # tokens served from the cache, like vllm:prefix_cache_hits

    def match(self, token_ids: Sequence[int], *, salt: str | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in whole blocks (the caller caps the length)."""
        if not self.enabled:
            return MatchResult(0)
        return self.match_hashes(extend_block_hashes([], token_ids, self.block_size, salt))

    def match_hashes(self, hashes: Sequence[BlockHash]) -> MatchResult:
        if not self.enabled:
            return MatchResult(0)
        blocks: list[KVBlock] = []
        for h in hashes:
            block = self.pool.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return MatchResult(len(blocks) * self.block_size, 0, blocks)

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        self.queries += query_tokens
        self.hits += hit_tokens

    def cache_blocks(self, blocks: Sequence[KVBlock], hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Register ``blocks[start:end]`` (full and computed) under ``hashes[start:end]``."""
        if not self.enabled:
            return
        if end > len(hashes) or end > len(blocks):
            raise KVIntegrityError(f"caching blocks up to {end}: {len(hashes)} hashes, {len(blocks)} blocks")
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])

    def reset(self) -> bool:
        """Forget every unreferenced cached block; True when the cache is now empty."""
        return self.pool.reset_prefix_cache()

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
