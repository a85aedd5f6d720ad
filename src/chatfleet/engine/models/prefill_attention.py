"""Causal attention of one multi-token chunk over its sequence's keys and values.

``chunk_attention(q, k, v, start, scale)``: q [n, Hq, D] holds positions ``start .. start+n-1``;
k, v [Hkv, start + n - key_start, D] cover the context from position ``key_start`` (0: all of it).
With a sliding ``window`` a query at position p sees only keys at p - window + 1 .. p. With the
``onednn`` kernels it runs as blocks of query rows through oneDNN matrix products: each block of
rows multiplies only the keys up to its own last position (so about half the products of a full
square), the ``g = Hq / Hkv`` query heads of one KV head are stacked into one matrix (one product
per KV head, no copies of K/V per query head), and softmax is computed in float32: on CPU about
1.4-2x faster than PyTorch's fused SDPA kernel, whose products go through MKL. A bf16 chunk on a
CPU with AMX takes ``chunk_attention_amx`` instead (one C++ pass per 16 query rows, the scores
never leave L2; ~3x faster than the blocks on an AMX Xeon, and chunk-invariant by construction);
a float32 chunk on a CPU with AVX-512 takes ``chunk_attention_avx512`` (the same plan with fused
multiply-adds, 32 query rows per tile; ~1.7x faster than the blocks on a Xeon without AMX), and so
does a bf16 chunk where there is no AMX (with AVX512_BF16's pair dot products, else widened to
float32; on an AMD EPYC Zen 4 the pair dots ran returning turns' attention 4-18x and cold 2K chunks
~2.4x faster than the bf16 blocks, whose every new shape JIT-compiles oneDNN products).
With ``torch`` it calls ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from chatfleet.engine.models import chunk_attention_amx as amx
from chatfleet.engine.models import chunk_attention_avx512 as avx512
from chatfleet.engine.models.linear import onednn_matmul_nt

QUERY_BLOCK = 128  # query positions per block (best of 64..512 for 500- and 2,000-token prompts)


@lru_cache(maxsize=64)
def _diagonal_bias(n: int, group: int, device: torch.device) -> torch.Tensor:
    """[n * group, n] float32: 0 where row r's position (r // group) may see column c, else -inf."""
    rows = torch.arange(n, device=device).repeat_interleave(group)
    cols = torch.arange(n, device=device)
    bias = torch.zeros(n * group, n, dtype=torch.float32, device=device)
    return bias.masked_fill_(cols[None, :] > rows[:, None], float("-inf"))


def _window_bias(first_query: int, rows: int, group: int, key_lo: int, key_hi: int, window: int,
                 device: torch.device) -> torch.Tensor:
    """[rows * group, key_hi - key_lo] float32: 0 where the query may see the key, else -inf
    (causal and inside the window; positions are absolute)."""
    qpos = torch.arange(first_query, first_query + rows, device=device).repeat_interleave(group)
    kpos = torch.arange(key_lo, key_hi, device=device)
    visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    return bias.masked_fill_(~visible, float("-inf"))


def _onednn_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                            scale: float, window: int | None = None, key_start: int = 0) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    group = num_heads // num_kv_heads
    # [Hkv, n, group, D]: a block of query rows of one KV head is one contiguous [rows * group, D]
    # (scaled and laid out in one pass).
    qh = torch.empty(num_kv_heads, n, group, head_dim, dtype=q.dtype, device=q.device)
    torch.mul(q.view(n, num_kv_heads, group, head_dim).transpose(0, 1), scale, out=qh)
    if k.stride(2) != 1 or k.stride(1) != head_dim:  # each head's rows must be contiguous
        k = k.contiguous()
    vt = v.transpose(1, 2).contiguous()  # [Hkv, D, ctx]: P @ V = P @ (V^T)^T
    out = torch.empty(n, num_kv_heads, group, head_dim, dtype=q.dtype, device=q.device)
    for qs in range(0, n, QUERY_BLOCK):
        qe = min(n, qs + QUERY_BLOCK)
        rows = qe - qs
        kv_end = start + qe - key_start  # keys this block may see (indices into k, v)
        kv_lo = 0 if window is None else max(0, start + qs - window + 1 - key_start)
        if window is None:
            bias = _diagonal_bias(rows, group, q.device)
        else:
            bias = _window_bias(start + qs, rows, group, key_start + kv_lo, key_start + kv_end, window, q.device)
        for h in range(num_kv_heads):
            scores = onednn_matmul_nt(qh[h, qs:qe].view(rows * group, head_dim), k[h, kv_lo:kv_end])
            if scores.dtype != torch.float32:
                scores = scores.float()
            if window is None:
                scores[:, start + qs - key_start : kv_end].add_(bias)
            else:
                scores.add_(bias)
            probs = scores.softmax(dim=-1)
            if probs.dtype != q.dtype:
                probs = probs.to(q.dtype)
            vh = vt[h, :, kv_lo:kv_end]
            whole = kv_lo == 0 and kv_end == vt.shape[2]
            out[qs:qe, h] = onednn_matmul_nt(probs, vh if whole else vh.contiguous()).view(
                rows, group, head_dim)
    return out.view(n, num_heads, head_dim)


def _sdpa_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                          scale: float, window: int | None = None, key_start: int = 0) -> torch.Tensor:
    n = q.shape[0]
    mask = None
    if start > 0 or window is not None or key_start > 0:
        ctx = start + n
        pos = torch.arange(start, ctx, device=q.device)
        kpos = torch.arange(key_start, ctx, device=q.device)
        mask = kpos[None, :] <= pos[:, None]
        if window is not None:
            mask &= kpos[None, :] > pos[:, None] - window
    # 4-D inputs (batch of one) take the fused CPU kernel; 3-D ones fall back to the math path.
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def runs_in_onednn(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether ``onednn`` chunks (no sliding window) of this dtype and head size go through oneDNN's
    products here (no C++ chunk kernel for them on this CPU), each chunk a new shape to oneDNN."""
    if dtype == torch.bfloat16 and head_dim in amx.HEAD_DIMS and amx.available():
        return False
    return not (dtype in avx512.DTYPES and head_dim in avx512.HEAD_DIMS and avx512.available())


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                    kernels: str = "torch", window: int | None = None, key_start: int = 0) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] (positions start..start+n-1) over k, v [Hkv, start+n-key_start, D]
    (positions key_start..start+n-1), limited to a sliding ``window`` when given.

    ``kernels``: a resolved kernel backend, ``onednn`` or ``torch``.
    """
    if kernels == "onednn":
        if q.dtype == torch.bfloat16 and amx.takes(q, k, v, start, window, key_start):
            return amx.chunk_attention_amx(q, k, v, start, scale)
        if avx512.takes(q, k, v, start, window, key_start):  # float32, or bf16 without AMX
            return avx512.chunk_attention_avx512(q, k, v, start, scale)
        return _onednn_chunk_attention(q, k, v, start, scale, window, key_start)
    return _sdpa_chunk_attention(q, k, v, start, scale, window, key_start)
