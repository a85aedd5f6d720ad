"""The KV manager interface the scheduler, the engine, the scheduling policies and the planner see.

Two managers implement it: ``PagedKVManager`` (``kv/manager.py``: one device pool, an optional
host tier) and ``HybridKVManager`` (``kv/hybrid.py``: a pool per layer group, sliding windows).
Neither caller knows which one it holds; pool statistics come from ``stats()``, a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from chatfleet.engine.kv.host_tier import HostTierStats
from chatfleet.engine.kv.prefix_cache import MatchResult
from chatfleet.engine.outputs import KVTransfer
from chatfleet.engine.request import Request

__all__ = ["KVBlocks", "KVManager", "KVStats"]


@dataclass(frozen=True)
class KVBlocks:
    """Blocks added to a request by one ``allocate`` call: prefix hits first, then new ones
    (the first ``num_loaded_blocks`` of the new ones are filled from the host tier)."""

    block_ids: list[int]
    num_hit_blocks: int = 0
    num_loaded_blocks: int = 0

    @property
    def num_new_blocks(self) -> int:
        return len(self.block_ids) - self.num_hit_blocks


@dataclass(frozen=True)
class KVStats:
    """A KV manager's pools at one moment (built on demand, for ``Engine.stats()`` and the planner)."""

    num_blocks: int  # of the primary pool (the one whose table is ``block_ids``)
    block_size: int
    usage: float  # referenced by requests / all (bytes over every pool), 0..1
    num_cached_blocks: int  # holding a prefix hash, in use or not (every pool)
    num_evictions: int  # cached blocks reused for other contents (every device pool)
    prefix_cache_queries: int  # tokens asked for (whole prompts)
    prefix_cache_hits: int  # tokens served from the device cache
    host: HostTierStats | None = None  # None without a host tier
    host_cache_queries: int = 0  # tokens the device cache missed, looked up in host memory
    host_cache_hits: int = 0  # tokens of those found there


class KVManager(Protocol):
    """Each request's KV block table(s), grown as its tokens are computed, and prefix reuse.

    Invariants (``check_integrity`` raises ``KVIntegrityError`` where one is broken):

    - A request holds KV (``has_blocks``) from its first successful ``allocate`` until ``free``;
      only running requests hold KV, and ``num_blocks_of(id) * block_size`` covers its computed
      tokens.
    - Every block's reference count equals the number of tables holding it (plus, with a host
      tier, the transfers in flight naming a host block); a table holds a block at most once.
    - ``allocate`` is all-or-nothing: None ("not now": the scheduler preempts or waits) changes
      nothing a request can see. ``new_blocks_needed`` (a request holding KV) and
      ``free_blocks_needed`` (one without, with its prefix match) say how many free blocks it
      takes, so callers may count blocks ahead of allocating: with one pool it succeeds exactly
      when the pool has that many; a manager of several pools reports the most any one takes.
    - A prefix hit (``match_prefix``) is made only for a request without KV, leaves at least its
      last token to compute, and is valid until the pools next change; a block registered by
      ``cache_computed`` holds exactly the KV of the tokens its hash names.
    - Transfers (host tier) named by ``take_transfers`` run in the next plan, before its forward
      pass; ``finish_transfers`` releases them after it ran.
    """

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int:
        """Blocks of the primary pool (every group's table has as many entries)."""
        ...

    @property
    def total_tokens(self) -> int:
        """The longest request the pools can ever hold."""
        ...

    @property
    def usage(self) -> float:
        """Referenced blocks / all blocks (0..1), read per step by policies and gauges."""
        ...

    @property
    def has_host_tier(self) -> bool:
        """Whether evictions may become transfers (a plan's ``kv_transfers``)."""
        ...

    @property
    def request_ids(self) -> list[str]:
        """The requests holding KV."""
        ...

    def match_prefix(self, request: Request) -> MatchResult:
        """The cached prefix of a request without KV (``NO_MATCH`` where none, or it has KV)."""
        ...

    def allocate(self, request: Request, num_new_tokens: int, *, prefix: MatchResult | None = None
                 ) -> KVBlocks | None:
        """Room for ``num_new_tokens`` after the request's computed tokens (plus ``prefix``'s hit
        blocks, for a request without KV); None, changing nothing, when the pools are short."""
        ...

    def new_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks ``allocate(request, num_new_tokens)`` takes for a request holding KV (the
        most over every pool, for a manager of several)."""
        ...

    def free_blocks_needed(self, request: Request, num_new_tokens: int, prefix: MatchResult) -> int:
        """Free blocks ``allocate(request, num_new_tokens, prefix=prefix)`` takes for a request
        without KV (new blocks plus revived cached hits; the most over every pool)."""
        ...

    def cache_computed(self, request: Request) -> None:
        """Register the request's full blocks whose KV is now computed in the prefix cache."""
        ...

    def free(self, request_id: str) -> None:
        """Release every block of the request (no-op when it holds none)."""
        ...

    def take_transfers(self) -> list[KVTransfer]:
        """The KV copies decided since the last call, for the next plan."""
        ...

    def finish_transfers(self) -> None:
        """The plan holding the last ``take_transfers`` ran: release their blocks."""
        ...

    def block_ids(self, request_id: str) -> list[int]:
        """The request's primary table (a copy; empty without KV)."""
        ...

    def group_block_ids(self, request_id: str) -> dict[str, list[int]] | None:
        """Each layer group's table by name, or None where ``block_ids`` serves every group."""
        ...

    def num_blocks_of(self, request_id: str) -> int: ...

    def has_blocks(self, request_id: str) -> bool: ...

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block's hash; False (some kept) while blocks are in use."""
        ...

    def stats(self) -> KVStats: ...

    def check_integrity(self) -> None: ...
