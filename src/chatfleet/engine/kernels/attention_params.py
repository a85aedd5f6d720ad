"""One attention layer's parameters as the paged attention kernels take them, and the plain
(dense, float32) attention the references use where the engine has no code of its own.

``AttentionParams``: the score ``scale`` (``head_dim**-0.5`` for Qwen3, 1.0 for Gemma 4), a
sliding ``window`` (a query at position p sees keys p - window + 1 .. p), a logit ``softcap``
(scores become ``softcap * tanh(scores / softcap)`` before the softmax) and the layer's FP8 KV
scales (``k_scale``/``v_scale``: an FP8 cache is read as ``fp8 * scale``; a 16/32-bit cache
ignores them, as ``decode_attention`` does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chatfleet.errors import ConfigError


@dataclass(frozen=True)
class AttentionParams:
    scale: float
    window: int | None = None
    softcap: float | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ConfigError(f"attention scale must be positive, got {self.scale}")
        if self.window is not None and self.window < 1:
            raise ConfigError(f"sliding window must be at least 1, got {self.window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ConfigError(f"logit softcap must be positive, got {self.softcap}")
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise ConfigError(f"KV scales must be positive, got {self.k_scale}, {self.v_scale}")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                    k_pos: torch.Tensor, params: AttentionParams) -> torch.Tensor:
    """q [n, Hq, D] at positions ``q_pos`` [n] over k, v [Hkv, m, D] (already dequantized) at
    positions ``k_pos`` [m]: causal, windowed and soft-capped as ``params`` say, in float32,
    returned in q's dtype. Every query must see at least one key."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[0]
    kf = k.float().repeat_interleave(group, dim=0)  # [Hq, m, D]
    vf = v.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("nhd,hmd->hnm", q.float(), kf) * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    visible = k_pos[None, :] <= q_pos[:, None]
    if params.window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - params.window
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("hnm,hmd->nhd", scores.softmax(dim=-1), vf)
    return out.to(q.dtype)
