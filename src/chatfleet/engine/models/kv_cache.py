"""One layer's paged KV cache, in the model's dtype or in FP8 (e4m3) with a K and a V scale.

``key`` / ``value``: ``[num_kv_heads, num_blocks, block_size, head_dim]``. An FP8 cache holds
``clamp(x / scale, -448, 448)`` as ``torch.float8_e4m3fn``; readers get ``fp8 * scale`` in the
compute dtype (``dequantize_fp8``). The scales are per layer and fixed once the first token is
written, so a block's raw bytes mean the same wherever they are copied (host tier, preemption).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chatfleet.engine.models.fp8_cast import fp8_dequantize, to_e4m3_normal
from chatfleet.engine.models.fp8_format import E4M3_MAX
from chatfleet.engine.models.huge_pages import zeroed_pieces
from chatfleet.engine.models.paged_decode_cpu import store_kv, store_kv_fp8

FP8 = torch.float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``clamp(x / scale, +-448)`` as e4m3 (computed in float32: one rounding, to FP8), never a
    subnormal code (``to_e4m3_normal``: decode attention multiplies the placed bits directly)."""
    y = x.float()
    if scale != 1.0:
        y = y / scale
    return to_e4m3_normal(y.clamp_(-E4M3_MAX, E4M3_MAX))


def dequantize_fp8(q: torch.Tensor, scale: float, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (into ``out`` when given)."""
    return fp8_dequantize(q, scale, dtype, out)


@dataclass
class KVCache:
    """One layer's paged cache; ``key``/``value``: [num_kv_heads, num_blocks, block_size, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor
    k_scale: float = 1.0  # used only by an FP8 cache
    v_scale: float = 1.0

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> KVCache:
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device), k_scale, v_scale)

    @classmethod
    def allocate_many(cls, shapes: Sequence[tuple[int, int, int, int]], dtype: torch.dtype,
                      device: torch.device | str, scales: Sequence[tuple[float, float]]) -> list[KVCache]:
        """One cache per (num_blocks, block_size, num_kv_heads, head_dim) with its (k_scale,
        v_scale), every K and V a view of one zeroed buffer: on the CPU 2 MiB aligned and on huge
        pages where the kernel allows (``huge_pages.py``: scattered blocks miss the TLB less)."""
        if len(shapes) != len(scales):
            raise ValueError(f"{len(shapes)} shapes but {len(scales)} scale pairs")
        itemsize = torch.empty((), dtype=dtype).element_size()
        pieces = zeroed_pieces([math.prod(s) * itemsize for s in shapes for _ in range(2)], device)
        caches = []
        for i, (shape, (k_scale, v_scale)) in enumerate(zip(shapes, scales, strict=True)):
            blocks, block_size, heads, head_dim = shape
            key, value = (pieces[2 * i + j].view(dtype).view(heads, blocks, block_size, head_dim) for j in (0, 1))
            caches.append(cls(key, value, k_scale, v_scale))
        return caches

    @property
    def is_fp8(self) -> bool:
        return self.key.dtype == FP8

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens: k, v [T, Hkv, D] into the flat slots ``slot_mapping`` [T]."""
        h, nb, bs, d = self.key.shape
        # one C++ pass on the CPU (an FP8 cache gets the same codes as quantize_fp8's)
        if (store_kv_fp8(self.key, self.value, slot_mapping, k, v, self.k_scale, self.v_scale) if self.is_fp8
                else store_kv(self.key, self.value, slot_mapping, k, v)):
            return
        if self.is_fp8:  # index_copy_ has no FP8 kernel: copy the bytes
            k = quantize_fp8(k, self.k_scale).view(torch.uint8)
            v = quantize_fp8(v, self.v_scale).view(torch.uint8)
            key, value = self.key.view(torch.uint8), self.value.view(torch.uint8)
        else:
            key, value = self.key, self.value
        key.view(h, nb * bs, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
        value.view(h, nb * bs, d).index_copy_(1, slot_mapping, v.transpose(0, 1))

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v as a read of the cache would return them (identity for an unquantized cache), so
        attention over a chunk's own keys sees what later reads of the cache see."""
        if not self.is_fp8:
            return k, v
        return (dequantize_fp8(quantize_fp8(k, self.k_scale), self.k_scale, k.dtype),
                dequantize_fp8(quantize_fp8(v, self.v_scale), self.v_scale, v.dtype))
