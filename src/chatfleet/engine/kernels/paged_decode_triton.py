"""Triton paged decode attention (see ``paged_decode.py`` for the contract).

One program per (sequence, KV head, context split): the ``GROUP = Hq / Hkv`` query heads of that
KV head are the rows of one tile (padded to 16, the smallest ``tl.dot``), so each K/V block is
read once for all of them. A program visits its split's blocks, in table order from the
window's first block to the context end, with an online softmax (running max and sum in
float32). FP8 blocks are widened to the query dtype (exact: every e4m3 value is a
bfloat16/float16 value) and the layer's scales applied to the scores (K) and the output (V).

With one split the program writes the output. With several (a small batch: B * Hkv programs
would leave most multiprocessors idle while a long context is read by a few) each writes its
normalised partial output and log-sum-exp in float32 and ``_combine_kernel`` merges them per
(sequence, head). The split count comes from host-known sizes only (batch, heads, table
width), never from the device's context lengths, so a captured graph keeps its launch shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatfleet.engine.kernels.attention_params import AttentionParams
from chatfleet.engine.kernels.backend import next_pow2
from chatfleet.engine.kernels.online_softmax_triton import block_scores, online_softmax_update
from chatfleet.engine.models.kv_cache import FP8

MIN_BLOCKS_PER_SPLIT = 8  # a split reads at least this many blocks (fewer: the merge costs more)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, lse_ptr, tables_ptr, lens_ptr,
    stride_qb, stride_qh, stride_ch, stride_cb, stride_cs, stride_tb, stride_ob, stride_oh,
    scale, k_scale, v_scale, softcap, window, blocks_per_split,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SCALED: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
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
    if SPLIT:
        first = tl.maximum(first, split * blocks_per_split)
        last = tl.minimum(last, (split + 1) * blocks_per_split)
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_base = kv_head.to(tl.int64) * stride_ch
    for i in range(first, last):
        block = tl.load(tables_ptr + seq.to(tl.int64) * stride_tb + i).to(tl.int64)
        offs = head_base + block * stride_cb + s[:, None] * stride_cs + d[None, :]
        k = tl.load(k_ptr + offs, mask=d_ok[None, :], other=0.0).to(q.dtype)
        scores = block_scores(q, k, score_scale, softcap, HAS_SOFTCAP, PRECISION)
        pos = i * BLOCK_SIZE + s
        visible = pos < ctx
        if HAS_WINDOW:
            visible = visible & (pos >= ctx - window)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        v = tl.load(v_ptr + offs, mask=d_ok[None, :], other=0.0).to(q.dtype)
        m_i, l_i, acc = online_softmax_update(scores, v, m_i, l_i, acc, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SCALED:
        out = out * v_scale
    if SPLIT:  # partials [B, Hq, splits, D] and log-sum-exp [B, Hq, splits] (-inf: an empty split)
        num_splits = tl.num_programs(2)
        rows = (seq * GROUP * tl.num_programs(1) + heads).to(tl.int64) * num_splits + split
        tl.store(part_ptr + rows[:, None] * BLOCK_D + d[None, :], out, mask=g_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + rows, lse, mask=g_ok)
    else:
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(part_ptr, lse_ptr, out_ptr, num_heads, num_splits, stride_ob, stride_oh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = sp < num_splits
    rows = (seq * num_heads + head).to(tl.int64) * num_splits + sp
    lse = tl.load(lse_ptr + rows, mask=s_ok, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, 0))  # every sequence has one non-empty split
    parts = tl.load(part_ptr + rows[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: full float32 products for float32 inputs (not TF32)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_splits(batch: int, num_kv_heads: int, table_width: int, device: torch.device) -> int:
    """Context splits so that about two programs per multiprocessor run, each over at least
    ``MIN_BLOCKS_PER_SPLIT`` blocks (host sizes only)."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    want = -(-target // max(1, batch * num_kv_heads))
    return max(1, min(want, table_width // MIN_BLOCKS_PER_SPLIT))


def paged_decode_triton(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, params: AttentionParams, scaled: bool | None = None,
                        num_splits: int | None = None) -> torch.Tensor:
    """``scaled``: apply the KV scales (default: when the cache is FP8, as the reference does);
    ``num_splits``: context splits per sequence (default: ``choose_splits``)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    scaled = key.dtype == FP8 if scaled is None else scaled
    width = block_tables.shape[1]
    splits = num_splits or choose_splits(batch, num_kv_heads, width, q.device)
    blocks_per_split = -(-width // splits)
    block_d = max(16, next_pow2(head_dim))
    if splits > 1:
        part = torch.empty(batch, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    _paged_decode_kernel[(batch, num_kv_heads, splits)](
        q, key, value, out, part, lse, block_tables, context_lens,
        q.stride(0), q.stride(1), key.stride(0), key.stride(1), key.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        params.scale, params.k_scale, params.v_scale, params.softcap or 1.0, params.window or 0, blocks_per_split,
        GROUP=group, BLOCK_G=max(16, next_pow2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, HAS_WINDOW=params.window is not None, HAS_SOFTCAP=params.softcap is not None,
        SCALED=scaled, PRECISION=precision(q.dtype), SPLIT=splits > 1,
    )
    if splits > 1:
        _combine_kernel[(batch, num_heads)](part, lse, out, num_heads, splits, out.stride(0), out.stride(1),
                                            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=next_pow2(splits))
    return out
