"""Paged KV memory: block pool, prefix cache, per-request manager."""

from chatfleet.engine.kv.block_pool import BlockHash, BlockPool, KVBlock, KVIntegrityError
from chatfleet.engine.kv.manager import KVBlocks, KVManager
from chatfleet.engine.kv.prefix_cache import MatchResult, PrefixCache

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVBlock",
    "KVBlocks",
    "KVIntegrityError",
    "KVManager",
    "MatchResult",
    "PrefixCache",
]
