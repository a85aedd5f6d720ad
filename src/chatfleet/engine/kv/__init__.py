"""Paged KV memory: blocks and hashes, block pools, prefix cache, host tier, per-request manager."""

from chatfleet.engine.block_hash import BlockHash
from chatfleet.engine.kv.base import KVBlocks, KVManager, KVStats
from chatfleet.engine.kv.block import BlockHint, KVBlock
from chatfleet.engine.kv.block_pool import BlockPool, Eviction
from chatfleet.engine.kv.host_tier import HostTier
from chatfleet.engine.kv.manager import PagedKVManager
from chatfleet.engine.kv.prefix_cache import MatchResult, PrefixCache
from chatfleet.errors import KVIntegrityError

__all__ = [
    "BlockHash",
    "BlockHint",
    "BlockPool",
    "Eviction",
    "HostTier",
    "KVBlock",
    "KVBlocks",
    "KVIntegrityError",
    "KVManager",
    "KVStats",
    "MatchResult",
    "PagedKVManager",
    "PrefixCache",
]
