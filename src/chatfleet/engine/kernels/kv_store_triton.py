"""Triton KV store (see ``kv_store.py``): one program per (token, KV head) writes its K and V
rows; with ``QUANTIZE`` the rows are divided by the layer's scale, clamped to +-448 and magnitudes
under e4m3's smallest normal (2**-6) snapped to 0 or 2**-6 before the store rounds them to FP8,
as ``kv_cache.quantize_fp8`` writes them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatfleet.engine.kernels.backend import next_pow2
from chatfleet.engine.models.fp8_format import E4M3_MAX
from chatfleet.engine.models.kv_cache import FP8

E4M3_MIN_NORMAL = 2.0**-6


@triton.jit
def _quantize(x, scale, LIMIT: tl.constexpr, MIN_NORMAL: tl.constexpr):
    y = x.to(tl.float32) / scale
    y = tl.minimum(tl.maximum(y, -LIMIT), LIMIT)
    a = tl.abs(y)
    sign = tl.where(y < 0, -1.0, 1.0)
    snapped = tl.where(a >= MIN_NORMAL / 2, sign * MIN_NORMAL, 0.0)
    return tl.where(a < MIN_NORMAL, snapped, y)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, key_ptr, value_ptr, slots_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cb, stride_cs,
    k_scale, v_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, QUANTIZE: tl.constexpr,
    LIMIT: tl.constexpr, MIN_NORMAL: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot < 0:  # a padding row
        return
    d = tl.arange(0, BLOCK_D)
    ok = d < HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok, other=0.0)
    if QUANTIZE:
        k = _quantize(k, k_scale, LIMIT, MIN_NORMAL)
        v = _quantize(v, v_scale, LIMIT, MIN_NORMAL)
    dst = h.to(tl.int64) * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + d
    tl.store(key_ptr + dst, k.to(key_ptr.dtype.element_ty), mask=ok)
    tl.store(value_ptr + dst, v.to(value_ptr.dtype.element_ty), mask=ok)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                    quantize: bool | None = None) -> None:
    """``quantize``: scale, clamp and snap before the store (default: when the cache is FP8)."""
    tokens, num_kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    quantize = key.dtype == FP8 if quantize is None else quantize
    _store_kv_kernel[(tokens, num_kv_heads)](
        k, v, key, value, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), key.stride(0), key.stride(1), key.stride(2),
        k_scale, v_scale,
        HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_SIZE=key.shape[2], QUANTIZE=quantize,
        LIMIT=E4M3_MAX, MIN_NORMAL=E4M3_MIN_NORMAL,
    )
