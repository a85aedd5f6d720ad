"""Executes a plan's KV transfers between the device KV cache and a host-memory copy of it.

The host tier is one tensor ``[layers * 2 (K, V), kv_heads, host_blocks, block_size, head_dim]``
in host memory, pinned when the device is CUDA (so loads are asynchronous DMA, queued before the
forward pass on the same stream). On CPU the same code path runs: the "device" cache is host
memory too, and a transfer is still an explicit gather and scatter of whole blocks.

Stores (device -> host) run before loads (host -> device): a block demoted this step may be the
source of a load, and a device block evicted this step is copied out before anything writes it.
"""

from __future__ import annotations

import time

import torch

from chatfleet.engine.models.attention import KVCache
from chatfleet.engine.outputs import KVTransfer, TransferDirection, TransferStats


def _raw(cache: KVCache) -> KVCache:
    """The cache's bytes as uint8 when it is FP8 (index_copy_ has no FP8 kernel); its scales are
    per layer, so the raw bytes are all a block carries."""
    if cache.key.dtype != torch.float8_e4m3fn:
        return cache
    return KVCache(cache.key.view(torch.uint8), cache.value.view(torch.uint8))


class HostKVTransfer:
    def __init__(self, caches: list[KVCache], num_host_blocks: int) -> None:
        caches = [_raw(c) for c in caches]
        first = caches[0].key
        self.caches = caches
        self.device = first.device
        self._pinned = self.device.type == "cuda"
        heads, _, block_size, head_dim = first.shape
        self.num_host_blocks = num_host_blocks
        self.host = torch.zeros(
            (2 * len(caches), heads, num_host_blocks, block_size, head_dim),
            dtype=first.dtype, pin_memory=self._pinned,
        )
        self.bytes_per_block = 2 * len(caches) * heads * block_size * head_dim * first.element_size()

    def execute(self, transfers: list[KVTransfer]) -> TransferStats:
        stored = loaded = 0
        t_store = t_load = 0.0
        for t in sorted(transfers, key=lambda t: t.direction != TransferDirection.STORE):
            start = time.perf_counter()
            if t.direction == TransferDirection.STORE:
                self._store(t)
                stored += t.num_blocks
                t_store += time.perf_counter() - start
            else:
                self._load(t)
                loaded += t.num_blocks
                t_load += time.perf_counter() - start
        return TransferStats(stored, loaded, stored * self.bytes_per_block, loaded * self.bytes_per_block,
                             t_store, t_load)

    def _store(self, t: KVTransfer) -> None:
        d_idx = torch.tensor(t.device_block_ids, dtype=torch.long, device=self.device)
        h_idx = torch.tensor(t.host_block_ids, dtype=torch.long)
        parts = []
        for c in self.caches:
            parts.append(c.key.index_select(1, d_idx))
            parts.append(c.value.index_select(1, d_idx))
        gathered = torch.stack(parts).to("cpu")  # blocking: the data must be on the host now
        self.host.index_copy_(2, h_idx, gathered)

    def _load(self, t: KVTransfer) -> None:
        h_idx = torch.tensor(t.host_block_ids, dtype=torch.long)
        shape = (self.host.shape[0], self.host.shape[1], len(t.host_block_ids), *self.host.shape[3:])
        staged = torch.empty(shape, dtype=self.host.dtype, pin_memory=self._pinned)
        torch.index_select(self.host, 2, h_idx, out=staged)
        # From pinned memory this is asynchronous; the caching host allocator keeps ``staged``
        # alive until the copy has completed, and the forward pass is queued after it.
        on_device = staged.to(self.device, non_blocking=self._pinned)
        d_idx = torch.tensor(t.device_block_ids, dtype=torch.long, device=self.device)
        for i, c in enumerate(self.caches):
            c.key.index_copy_(1, d_idx, on_device[2 * i])
            c.value.index_copy_(1, d_idx, on_device[2 * i + 1])
