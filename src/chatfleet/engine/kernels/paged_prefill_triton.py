"""Triton paged prefill attention (see ``paged_prefill.py`` for the contract).

One program per (chunk, tile of ``BLOCK_M`` query rows, query head). It visits the cache
blocks from the first one its earliest query's window reaches to the one holding its last
query's position, with an online softmax; a key is visible where its position is at most the
query's (and inside the window). FP8 blocks are widened to the query dtype and the layer's
scales applied to the scores (K) and the output (V), as in the decode kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatfleet.engine.kernels.attention_params import AttentionParams
from chatfleet.engine.kernels.backend import next_pow2
from chatfleet.engine.kernels.online_softmax_triton import block_scores, online_softmax_update
from chatfleet.engine.kernels.paged_decode_triton import precision
from chatfleet.engine.models.kv_cache import FP8

BLOCK_M = 16  # query rows per program


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, lens_ptr,
    stride_qt, stride_qh, stride_ch, stride_cb, stride_cs, stride_tb, stride_ot, stride_oh,
    scale, k_scale, v_scale, softcap, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(starts_ptr + chunk)
    n = tl.load(starts_ptr + chunk + 1) - q_start
    row0 = tile * BLOCK_M
    if row0 >= n:
        return
    ctx = tl.load(lens_ptr + chunk)
    start = ctx - n  # position of the chunk's first query
    r = row0 + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_SIZE)
    r_ok = r < n
    d_ok = d < HEAD_DIM
    q_pos = start + r
    rows = (q_start + r).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    score_scale = scale
    if SCALED:
        score_scale = scale * k_scale
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(start + row0 - window + 1, 0) // BLOCK_SIZE
    last = tl.cdiv(start + tl.minimum(row0 + BLOCK_M, n), BLOCK_SIZE)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    head_base = (head // GROUP).to(tl.int64) * stride_ch
    for i in range(first, last):
        block = tl.load(tables_ptr + chunk.to(tl.int64) * stride_tb + i).to(tl.int64)
        offs = head_base + block * stride_cb + s[:, None] * stride_cs + d[None, :]
        k = tl.load(k_ptr + offs, mask=d_ok[None, :], other=0.0).to(q.dtype)
        scores = block_scores(q, k, score_scale, softcap, HAS_SOFTCAP, PRECISION)
        k_pos = i * BLOCK_SIZE + s
        visible = (k_pos[None, :] <= q_pos[:, None]) & r_ok[:, None]
        if HAS_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        v = tl.load(v_ptr + offs, mask=d_ok[None, :], other=0.0).to(q.dtype)
        m_i, l_i, acc = online_softmax_update(scores, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SCALED:
        out = out * v_scale
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])


def paged_prefill_triton(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                         query_starts: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                         params: AttentionParams, scaled: bool | None = None) -> torch.Tensor:
    """``scaled``: apply the KV scales (default: when the cache is FP8, as the reference does)."""
    tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = key.shape
    out = torch.empty_like(q)
    chunks = context_lens.shape[0]
    if tokens == 0 or chunks == 0 or max_query_len == 0:
        return out
    scaled = key.dtype == FP8 if scaled is None else scaled
    grid = (chunks, triton.cdiv(max_query_len, BLOCK_M), num_heads)
    _paged_prefill_kernel[grid](
        q, key, value, out, block_tables, query_starts, context_lens,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        params.scale, params.k_scale, params.v_scale, params.softcap or 1.0, params.window or 0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, HAS_WINDOW=params.window is not None,
        HAS_SOFTCAP=params.softcap is not None, SCALED=scaled, PRECISION=precision(q.dtype),
    )
    return out
