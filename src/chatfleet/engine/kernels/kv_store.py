"""Store a step's new keys and values into their cache slots.

``store_kv(k, v, key, value, slot_mapping, k_scale, v_scale)``: k, v [T, Hkv, D] go to flat
slots ``slot_mapping`` [T] (slot = block * block_size + offset) of the layer's cache
``[Hkv, num_blocks, block_size, D]``; an FP8 cache stores ``clamp(x / scale, +-448)`` in e4m3
without subnormal codes (``kv_cache.quantize_fp8``). The kernel skips negative slots (padding
rows of a fixed-size batch, as a captured graph has); the reference drops them first.

Reference: ``KVCache.write``, the engine's store.
"""

from __future__ import annotations

import torch

from chatfleet.engine.kernels.backend import interpreting, resolve_backend
from chatfleet.engine.models.kv_cache import FP8, KVCache


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    KVCache(key, value, k_scale, v_scale).write(slot_mapping.long(), k, v)


def unsupported_reason(k: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    if key.dtype != value.dtype or key.shape != value.shape or key.stride() != value.stride():
        return "key and value caches differ in dtype, shape or layout"
    if key.dtype not in (FP8, torch.float16, torch.bfloat16, torch.float32):
        return f"a {key.dtype} cache"
    if key.stride(3) != 1 or k.stride(2) != 1:
        return "the head dimension is not contiguous"
    if key.dtype != FP8 and k.dtype != key.dtype:
        return f"{k.dtype} rows for a {key.dtype} cache"
    if not k.is_cuda and interpreting() and (key.dtype == FP8 or k.dtype == torch.bfloat16):
        return "the Triton interpreter has no bfloat16/FP8 arithmetic"
    return None


def store_kv(k: torch.Tensor, v: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0, backend: str = "auto") -> None:
    """Write k, v [T, Hkv, D] into the cache at ``slot_mapping`` [T] (see the module doc)."""
    tensors = (k, v, key, value, slot_mapping)
    if resolve_backend(backend, tensors, unsupported_reason(k, key, value)) == "torch":
        store_kv_reference(k, v, key, value, slot_mapping, k_scale, v_scale)
        return
    from chatfleet.engine.kernels.kv_store_triton import store_kv_triton

    store_kv_triton(k, v, key, value, slot_mapping, k_scale, v_scale)
