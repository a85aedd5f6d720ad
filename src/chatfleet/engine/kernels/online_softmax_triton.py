"""The inner step both paged attention kernels share: one KV block's scores, then the online
softmax update of the running max, sum and output (float32), as in flash attention."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_scores(q, k, score_scale, softcap, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """``q @ k.T`` scaled, soft-capped where the layer caps its logits."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * score_scale
    if HAS_SOFTCAP:
        scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)  # softcap * tanh(x / softcap)
    return scores


@triton.jit
def online_softmax_update(scores, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one block's masked ``scores`` (-inf where hidden) and its values ``v`` into the running
    max ``m_i``, sum ``l_i`` and unnormalised output ``acc``; returns the three."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc
