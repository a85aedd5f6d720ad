"""A sequence's context read back from the paged cache (for the references): the blocks that
hold positions ``first_block * block_size .. ctx - 1``, dequantized when the cache is FP8."""

from __future__ import annotations

import torch

from chatfleet.engine.models.kv_cache import FP8, dequantize_fp8
from chatfleet.engine.models.workspace import gather_blocks


def first_block(ctx_start: int, window: int | None, block_size: int) -> int:
    """The first block a query at position ``ctx_start`` (the earliest query) can read."""
    return 0 if window is None else max(0, ctx_start - window + 1) // block_size


def read_context(cache: torch.Tensor, table: list[int], first: int, ctx: int, scale: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, ctx - first * block_size, D] in ``dtype``: positions ``first * block_size .. ctx - 1``."""
    num_kv_heads, _, block_size, head_dim = cache.shape
    nblocks = -(-ctx // block_size)
    ids = torch.tensor(table[first:nblocks], dtype=torch.long, device=cache.device)
    raw = gather_blocks(cache, ids, None, "").reshape(num_kv_heads, -1, head_dim)[:, : ctx - first * block_size]
    if raw.dtype == FP8:
        return dequantize_fp8(raw, scale, dtype)
    return raw.to(dtype)
