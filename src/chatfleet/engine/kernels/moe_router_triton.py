"""Triton top-k softmax (see ``moe_router.py``): one program per token holds its row of
logits, takes the softmax in float32, then picks the largest probability ``top_k`` times
(ties to the lowest expert index), renormalises the picks and applies the per-expert scale."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatfleet.engine.kernels.backend import next_pow2
from chatfleet.engine.models.moe import RouterChoice


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, scale_ptr, experts_ptr, weights_ptr, E, stride_t,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    x = tl.load(logits_ptr + t * stride_t + e, mask=e_ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e_ok, p, -1.0)
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], tl.float32)
    picked_e = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), 0)  # lowest index among equal maxima
        picked_w = tl.where(slots == j, best, picked_w)
        picked_e = tl.where(slots == j, idx, picked_e)
        p = tl.where(e == idx, -1.0, p)
    k_ok = slots < TOP_K
    picked_w = picked_w / tl.sum(tl.where(k_ok, picked_w, 0.0), 0)
    if HAS_SCALE:
        picked_w = picked_w * tl.load(scale_ptr + picked_e, mask=k_ok, other=1.0).to(tl.float32)
    tl.store(experts_ptr + t * TOP_K + slots, picked_e.to(tl.int64), mask=k_ok)
    tl.store(weights_ptr + t * TOP_K + slots, picked_w, mask=k_ok)


def topk_softmax_triton(logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor | None = None) -> RouterChoice:
    tokens, num_experts = logits.shape
    experts = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    if tokens:
        scale = per_expert_scale.contiguous() if per_expert_scale is not None else logits
        _topk_softmax_kernel[(tokens,)](
            logits, scale, experts, weights, num_experts, logits.stride(0),
            TOP_K=top_k, BLOCK_E=next_pow2(num_experts), BLOCK_K=next_pow2(top_k),
            HAS_SCALE=per_expert_scale is not None,
        )
    return RouterChoice(experts, weights)
