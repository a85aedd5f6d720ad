"""Reusable scratch memory for gathered KV blocks, and the block gather itself."""

from __future__ import annotations

import torch


class Workspace:
    """Grow-only scratch memory for gathered keys/values, reused by every layer and step."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else 0), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, workspace: Workspace | None,
                  name: str) -> torch.Tensor:
    """cache[:, block_ids] -> [Hkv, len(block_ids), block, D], into the workspace when given."""
    if workspace is None:
        return cache.index_select(1, block_ids)
    shape = (cache.shape[0], block_ids.numel(), cache.shape[2], cache.shape[3])
    out = workspace.get(name, shape, cache.dtype, cache.device)
    return torch.index_select(cache, 1, block_ids, out=out)
