"""The host tier: a second block pool in host memory that catches what the device pool evicts.

Demotion: when the device pool evicts a cached block (``BlockPool.on_evict``), the tier takes a
host block (evicting by its own policy if it must), registers it under the same hash and plans
a STORE (device -> host). Promotion: a prefix match that continues in the host pool plans a
LOAD (host -> device) into fresh device blocks of the request. The transfers of one plan run
before its forward pass, stores before loads; so a device block evicted this step is copied out
before its new owner writes it, and a host block demoted this step is readable by a load.

Host blocks named by a planned transfer hold a reference ("in flight") until the plan has run
(``finish_transfers``), so no later decision of the same step can reuse them. The host copy of
a promoted block stays cached (the tiers are inclusive): evicting the device copy again costs
no store.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from chatfleet.engine.kv.block import KVBlock
from chatfleet.engine.kv.block_pool import BlockPool, Eviction
from chatfleet.engine.outputs import KVTransfer, TransferDirection
from chatfleet.errors import KVIntegrityError


@dataclass(frozen=True)
class HostTierStats:
    num_blocks: int
    num_cached_blocks: int
    promotions: int  # blocks loaded host -> device
    demotions: int  # blocks stored device -> host
    demotions_skipped: int  # device evictions already held by the host pool
    demotions_dropped: int  # device evictions lost: every host block was in flight
    evictions: int  # host blocks reused for other contents


class HostTier:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        pool.on_evict = self._on_host_evict
        self._stores: list[tuple[int, int]] = []  # (device block id, host block id)
        self._loads: list[tuple[int, int]] = []
        self._storing: list[KVBlock] = []  # host blocks referenced until the plan has run
        self._loading: list[KVBlock] = []
        self.promotions = 0
        self.demotions = 0
        self.demotions_skipped = 0
        self.demotions_dropped = 0
        self.evictions = 0

    # ---- planning ------------------------------------------------------------------------------
    def demote(self, eviction: Eviction) -> None:
        """Plan to keep an evicted device block's contents in host memory."""
        if self.pool.lookup(eviction.block_hash) is not None:
            self.demotions_skipped += 1
            return
        if self.pool.num_free_blocks == 0:
            self.demotions_dropped += 1
            return
        (host,) = self.pool.allocate(1)
        hint = eviction.hint
        host.session_id, host.last_use = hint.session_id, hint.last_use
        host.num_uses, host.num_sessions = hint.num_uses, hint.num_sessions
        self.pool.cache_block(host, eviction.block_hash)
        self._stores.append((eviction.block_id, host.block_id))
        self._storing.append(host)
        self.demotions += 1

    def promote(self, host_blocks: list[KVBlock], device_blocks: list[KVBlock], session_id: str | None) -> None:
        """Plan to load ``host_blocks`` into ``device_blocks`` (already the request's).

        The caller pins ``host_blocks`` with ``pin`` before allocating the device blocks (an
        allocation may demote, and a demotion may evict an unpinned host block).
        """
        for host, device in zip(host_blocks, device_blocks, strict=False):
            self._loads.append((device.block_id, host.block_id))
            device.num_uses = max(device.num_uses, host.num_uses)
            device.num_sessions = max(device.num_sessions, host.num_sessions)
        self.promotions += len(host_blocks)

    def pin(self, host_blocks: list[KVBlock], session_id: str | None) -> None:
        self.pool.touch(host_blocks, session_id)
        self._loading.extend(host_blocks)

    def take_transfers(self) -> list[KVTransfer]:
        """The transfers planned since the last call: one STORE, then one LOAD (either may be
        absent). Their host blocks stay pinned until ``finish_transfers``."""
        out = []
        if self._stores:
            d, h = zip(*self._stores, strict=False)
            out.append(KVTransfer(TransferDirection.STORE, d, h))
        if self._loads:
            d, h = zip(*self._loads, strict=False)
            out.append(KVTransfer(TransferDirection.LOAD, d, h))
        self._stores, self._loads = [], []
        return out

    def finish_transfers(self) -> None:
        """The plan has run: unpin its host blocks (they stay cached)."""
        if self._storing:
            self.pool.free(self._storing, stamp=False)
            self._storing = []
        if self._loading:
            self.pool.free(self._loading)
            self._loading = []

    @property
    def num_in_flight(self) -> int:
        return len(self._storing) + len(self._loading)

    def _on_host_evict(self, eviction: Eviction) -> None:
        self.evictions += 1  # the end of the line: the contents are recomputed if needed again

    def check_integrity(self) -> None:
        """The host pool's invariants, plus: each host block's references == in-flight transfers."""
        self.pool.check_integrity()
        refs = Counter(b.block_id for b in self._storing + self._loading)
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise KVIntegrityError(f"host {block!r} is named by {refs.get(block.block_id, 0)} transfers")

    def stats(self) -> HostTierStats:
        return HostTierStats(
            self.pool.num_blocks, self.pool.num_cached_blocks, self.promotions, self.demotions,
            self.demotions_skipped, self.demotions_dropped, self.evictions,
        )
