"""Executes a plan's KV transfers between the device KV cache and a host-memory copy of it.

The host tier is one tensor ``[host_blocks, layers * 2 (K, V), kv_heads, block_size, head_dim]``
in host memory, one contiguous slab per block, pinned when the device is CUDA: a store is a
device-side gather and one asynchronous DMA per block into its slab, a load one DMA per block
into a device staging buffer and a scatter into the cache, all on the copy engine's own stream
(``copy_engine.py``). The compute stream waits on a load's event before the forward pass reads
it; a device block whose store is still in flight is waited on before a step writes into it
(``before_write``). On CPU the same code runs with immediate copies: the "device" cache is host
memory too, and a transfer moves whole blocks in one pass over their bytes (``block_copy.py``,
where its kernel builds; else a gather and a scatter in torch ops).

Stores (device -> host) run before loads (host -> device): a block demoted this step may be the
source of a load, and a device block evicted this step is copied out before anything writes it.
Transfer times are what submitting the copies took (on CUDA the copies themselves overlap).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from functools import partial

import torch

from chatfleet.engine.models.attention import KVCache
from chatfleet.engine.outputs import KVTransfer, TransferDirection, TransferStats
from chatfleet.engine.runner.block_copy import BlockCopier
from chatfleet.engine.runner.copy_engine import CopyEngine, CopyEvent, copy_engine_for


def _raw(cache: KVCache) -> KVCache:
    """The cache's bytes as uint8 when it is FP8 (index_copy_ has no FP8 kernel); its scales are
    per layer, so the raw bytes are all a block carries."""
    if cache.key.dtype != torch.float8_e4m3fn:
        return cache
    return KVCache(cache.key.view(torch.uint8), cache.value.view(torch.uint8))


class HostKVTransfer:
    def __init__(self, caches: list[KVCache], num_host_blocks: int, copies: CopyEngine | None = None) -> None:
        caches = [_raw(c) for c in caches]
        first = caches[0].key
        self.caches = caches
        self.device = first.device
        self._pinned = self.device.type == "cuda"
        self.copies = copies if copies is not None else copy_engine_for(self.device)
        heads, _, block_size, head_dim = first.shape
        self.num_host_blocks = num_host_blocks
        self.host = torch.zeros(
            (num_host_blocks, 2 * len(caches), heads, block_size, head_dim),
            dtype=first.dtype, pin_memory=self._pinned,
        )
        self.bytes_per_block = 2 * len(caches) * heads * block_size * head_dim * first.element_size()
        # CPU: one memcpy per block chunk instead of torch's gather and scatter passes
        self._copier = None if self._pinned else BlockCopier.for_tensors(
            self.host, [t for c in caches for t in (c.key, c.value)])
        self._stores_in_flight: dict[int, CopyEvent] = {}  # device block -> its store's event

    def execute(self, transfers: list[KVTransfer]) -> TransferStats:
        stored = loaded = 0
        t_store = t_load = 0.0
        self.copies.after_compute()
        for t in sorted(transfers, key=lambda t: t.direction != TransferDirection.STORE):
            start = time.perf_counter()
            if t.direction == TransferDirection.STORE:
                event = self.copies.submit(partial(self._store, t))
                if not event.done():
                    self._stores_in_flight.update(dict.fromkeys(t.device_block_ids, event))
                stored += t.num_blocks
                t_store += time.perf_counter() - start
            else:
                self.copies.wait(self.copies.submit(partial(self._load, t)))  # the step reads it
                loaded += t.num_blocks
                t_load += time.perf_counter() - start
        return TransferStats(stored, loaded, stored * self.bytes_per_block, loaded * self.bytes_per_block,
                             t_store, t_load)

    def before_write(self, device_block_ids: Iterable[int]) -> None:
        """Order the compute stream after the stores still reading any of these device blocks."""
        if not self._stores_in_flight:
            return
        for b in device_block_ids:
            event = self._stores_in_flight.pop(b, None)
            if event is not None and not event.done():
                self.copies.wait(event)
        self._stores_in_flight = {b: e for b, e in self._stores_in_flight.items() if not e.done()}

    @property
    def stores_in_flight(self) -> int:
        return len(self._stores_in_flight)

    def _store(self, t: KVTransfer) -> None:
        if self._copier is not None:
            self._copier.copy(t.host_block_ids, t.device_block_ids, to_host=True)
            return
        d_idx = torch.tensor(t.device_block_ids, dtype=torch.long, device=self.device)
        parts = []
        for c in self.caches:
            parts.append(c.key.index_select(1, d_idx))
            parts.append(c.value.index_select(1, d_idx))
        blocks = torch.stack(parts).permute(2, 0, 1, 3, 4)  # [n, 2 * layers, heads, block, dim]
        if not self._pinned:
            self.host.index_copy_(0, torch.tensor(t.host_block_ids, dtype=torch.long), blocks)
            return
        blocks = blocks.contiguous()
        for j, h in enumerate(t.host_block_ids):  # DMA into each block's pinned slab
            self.host[h].copy_(blocks[j], non_blocking=True)

    def _load(self, t: KVTransfer) -> None:
        if self._copier is not None:
            self._copier.copy(t.host_block_ids, t.device_block_ids, to_host=False)
            return
        if self._pinned:
            staged = torch.empty((len(t.host_block_ids), *self.host.shape[1:]), dtype=self.host.dtype,
                                 device=self.device)
            for j, h in enumerate(t.host_block_ids):
                staged[j].copy_(self.host[h], non_blocking=True)
        else:
            staged = self.host.index_select(0, torch.tensor(t.host_block_ids, dtype=torch.long))
        d_idx = torch.tensor(t.device_block_ids, dtype=torch.long, device=self.device)
        for i, c in enumerate(self.caches):
            c.key.index_copy_(1, d_idx, staged[:, 2 * i].transpose(0, 1))
            c.value.index_copy_(1, d_idx, staged[:, 2 * i + 1].transpose(0, 1))
