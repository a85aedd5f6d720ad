"""Triton paged decode attention (see ``paged_decode.py`` for the contract).

One program per (sequence, KV head): the ``GROUP = Hq / Hkv`` query heads of that KV head are
the rows of one tile (padded to 16, the smallest ``tl.dot``), so each K/V block is read once for
all of them. Blocks are visited in table order from the window's first block to the context
end with an online softmax (running max and sum in float32). FP8 blocks are widened to the
query dtype (exact: every e4m3 value is a bfloat16/float16 value) and the layer's scales are
applied to the scores (K) and to the output (V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatfleet.engine.kernels.attention_params import AttentionParams
from chatfleet.engine.kernels.backend import next_pow2
from chatfleet.engine.models.kv_cache import FP8


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
    stride_qb, stride_qh, stride_ch, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh,
    scale, k_scale, v_scale, softcap, window,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_SIZE)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    score_scale = scale
    if SCALED:
        score_scale = scale * k_scale
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx - window, 0) // BLOCK_SIZE
    last = tl.cdiv(ctx, BLOCK_SIZE)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_base = kv_head.to(tl.int64) * stride_ch
    for i in range(first, last):
        block = tl.load(tables_ptr + seq.to(tl.int64) * stride_tb + i).to(tl.int64)
        offs = head_base + block * stride_cb + s[:, None] * stride_cs + d[None, :]
        k = tl.load(k_ptr + offs, mask=d_ok[None, :], other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_scale
        if HAS_SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap * tanh(x / softcap)
        pos = i * BLOCK_SIZE + s
        visible = pos < ctx
        if HAS_WINDOW:
            visible = visible & (pos >= ctx - window)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + offs, mask=d_ok[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    if SCALED:
        out = out * v_scale
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & d_ok[None, :])


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: full float32 products for float32 inputs (not TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_triton(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, params: AttentionParams,
                        scaled: bool | None = None) -> torch.Tensor:
    """``scaled``: apply the KV scales (default: when the cache is FP8, as the reference does)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    scaled = key.dtype == FP8 if scaled is None else scaled
    _paged_decode_kernel[(batch, num_kv_heads)](
        q, key, value, out, block_tables, context_lens,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        params.scale, params.k_scale, params.v_scale, params.softcap or 1.0, params.window or 0,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_SIZE=block_size, HAS_WINDOW=params.window is not None, HAS_SOFTCAP=params.softcap is not None,
        SCALED=scaled, PRECISION=precision(q.dtype),
    )
    return out
