"""An embedding table stored in FP8 (e4m3) with one float32 scale per row.

``FP8Embedding`` serves both uses of a (tied) table: ``forward(ids)`` looks rows up and
dequantizes only those; ``logits(hidden)`` multiplies by the whole table a chunk of rows at a
time (``LOGITS_CHUNK`` rows dequantized at once), never the whole table in 16/32 bits.
"""

from __future__ import annotations

import torch
from torch import nn

from chatfleet.engine.models.fp8_cast import FP8_DOWN, fp8_to_down
from chatfleet.engine.models.fp8_format import E4M3_MAX

FP8 = torch.float8_e4m3fn
LOGITS_CHUNK = 8192  # vocabulary rows dequantized at a time for the output projection


def quantize_rows(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``table [rows, dim]`` -> (e4m3 table, float32 scale per row = row amax / 448)."""
    t = table.detach().float()
    scale = (t.abs().amax(dim=1) / E4M3_MAX).clamp_min(1e-12)
    return (t / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8), scale


class FP8Embedding(nn.Module):
    """Buffers ``weight`` (e4m3 ``[num_embeddings, dim]``) and ``row_scale`` (float32 ``[num_embeddings]``)."""

    weight: torch.Tensor  # registered buffers, declared for the type checker
    row_scale: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self.register_buffer("weight", torch.empty(num_embeddings, embedding_dim, dtype=FP8))
        self.register_buffer("row_scale", torch.ones(num_embeddings, dtype=torch.float32))

    def load(self, table: torch.Tensor) -> None:
        """Quantize a float table into this module (row by row scales)."""
        if tuple(table.shape) != tuple(self.weight.shape):
            raise ValueError(f"embedding has shape {tuple(table.shape)}, expected {tuple(self.weight.shape)}")
        q, s = quantize_rows(table)
        self.weight.copy_(q)
        self.row_scale.copy_(s)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = fp8_to_down(self.weight[ids], self.dtype)
        return rows.mul_((self.row_scale[ids] * FP8_DOWN).to(self.dtype).unsqueeze(-1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, dim] @ table^T`` -> float32 ``[N, num_embeddings]``, a chunk of rows at a time."""
        out = torch.empty(hidden.shape[0], self.num_embeddings, dtype=torch.float32, device=hidden.device)
        for start in range(0, self.num_embeddings, LOGITS_CHUNK):
            end = min(start + LOGITS_CHUNK, self.num_embeddings)
            chunk = fp8_to_down(self.weight[start:end], hidden.dtype)
            part = hidden @ chunk.t()
            out[:, start:end] = part.float().mul_(self.row_scale[start:end] * FP8_DOWN)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, fp8 e4m3 with per-row scales"
