"""Paged decode attention: one query token per sequence over its blocks of the paged cache.

``paged_decode_attention(q, key, value, block_tables, context_lens, params)``: q [B, Hq, D];
key/value the layer's cache ``[Hkv, num_blocks, block_size, D]`` (the model's dtype, or FP8
e4m3 read as ``fp8 * k_scale`` / ``fp8 * v_scale``); ``block_tables`` [B, max_blocks] int32
(rows may be longer than needed; with a window, entries before the window are never read);
``context_lens`` [B] counting each sequence's new token, which is already in the cache.
GQA (Hq a multiple of Hkv), a sliding window and a logit softcap follow ``params``; a layer
that reads another layer's KV (Gemma 4's KV sharing) or keeps V equal to K passes those
tensors (``value`` may be ``key``).

Reference: the engine's own ``decode_attention`` over ``build_decode_groups`` (what every step
computes today); with a softcap, which the engine has no decode code for, dense float32
attention per sequence (``attention_params.dense_attention``).
"""

from __future__ import annotations

import torch

from chatfleet.engine.kernels.attention_params import AttentionParams, dense_attention
from chatfleet.engine.kernels.backend import interpreting, is_pow2, resolve_backend
from chatfleet.engine.kernels.paged_read import first_block, read_context
from chatfleet.engine.models.decode_attention import build_decode_groups, decode_attention
from chatfleet.engine.models.kv_cache import FP8

COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def paged_decode_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    block_size = key.shape[2]
    lens, tables = context_lens.tolist(), block_tables.tolist()
    if params.softcap is None:
        groups = build_decode_groups(lens, tables, block_size, q.device, window=params.window)
        return decode_attention(q, key, value, groups, None, params.scale, params.k_scale, params.v_scale)
    out = torch.empty_like(q)
    for i, (ctx, table) in enumerate(zip(lens, tables, strict=True)):
        first = first_block(ctx - 1, params.window, block_size)
        k = read_context(key, table, first, ctx, params.k_scale, q.dtype)
        v = read_context(value, table, first, ctx, params.v_scale, q.dtype)
        k_pos = torch.arange(first * block_size, ctx, device=q.device)
        q_pos = torch.tensor([ctx - 1], device=q.device)
        out[i : i + 1] = dense_attention(q[i : i + 1], k, v, q_pos, k_pos, params)
    return out


def unsupported_reason(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot take this call (None: they can); shared by decode and prefill."""
    if q.dtype not in COMPUTE_DTYPES:
        return f"queries in {q.dtype}"
    if key.dtype != value.dtype or key.shape != value.shape or key.stride() != value.stride():
        return "key and value caches differ in dtype, shape or layout"
    if key.dtype not in (q.dtype, FP8):
        return f"a {key.dtype} cache with {q.dtype} queries"
    num_kv_heads, _, block_size, head_dim = key.shape
    if q.shape[1] % num_kv_heads or q.shape[2] != head_dim:
        return "query heads or head size do not match the cache"
    if not is_pow2(block_size) or block_size < 16 or head_dim < 16:
        return f"block size {block_size} / head size {head_dim} (needs a power of two >= 16 / >= 16)"
    if key.stride(3) != 1 or q.stride(2) != 1:
        return "the head dimension is not contiguous"
    if not q.is_cuda and interpreting() and (key.dtype == FP8 or q.dtype == torch.bfloat16):
        return "the Triton interpreter has no bfloat16/FP8 arithmetic"
    return None


def paged_decode_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, params: AttentionParams,
                           backend: str = "auto") -> torch.Tensor:
    """q [B, Hq, D] over the paged cache -> [B, Hq, D] (see the module doc)."""
    tensors = (q, key, value, block_tables, context_lens)
    if resolve_backend(backend, tensors, unsupported_reason(q, key, value)) == "torch":
        return paged_decode_reference(q, key, value, block_tables, context_lens, params)
    from chatfleet.engine.kernels.paged_decode_triton import paged_decode_triton

    return paged_decode_triton(q, key, value, block_tables, context_lens, params)
