"""Gemma 4's routed experts over stacked weights, through the grouped GEMM.

``expert_mlp(x, choice, gate_up, down)``: x [T, H]; ``choice`` the router's ``RouterChoice``;
``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (each optionally e4m3 with block scales). As
``moe.Experts`` computes it: the ``T * k`` (token, expert) pairs sorted by expert (stable),
each expert's rows through ``down(gelu_tanh(gate) * up)``, the rows weighted and summed back
per token. Both products are one ``grouped_gemm`` launch each; ``backend`` is passed to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chatfleet.engine.kernels.grouped_gemm import grouped_gemm
from chatfleet.engine.models.moe import RouterChoice


@dataclass(frozen=True)
class StackedExperts:
    """Every expert's two projections stacked: gate_up [E, 2I, H], down [E, H, I] (+ FP8 scales)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.down.shape[2]


def expert_mlp(x: torch.Tensor, choice: RouterChoice, experts: StackedExperts, backend: str = "auto") -> torch.Tensor:
    top_k = choice.experts.shape[1]
    flat = choice.experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # (token, slot) pairs grouped by expert
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=experts.num_experts)
    offsets = torch.zeros(experts.num_experts + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = torch.cumsum(counts, 0)
    rows = x.index_select(0, token_of)
    h = grouped_gemm(rows, offsets, experts.gate_up, experts.gate_up_scale, experts.block, backend)
    gate, up = h.split(experts.intermediate_size, dim=-1)
    act = F.gelu(gate, approximate="tanh").mul_(up)
    out = grouped_gemm(act, offsets, experts.down, experts.down_scale, experts.block, backend)
    weighted = (out * choice.weights.reshape(-1)[order, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, weighted)
