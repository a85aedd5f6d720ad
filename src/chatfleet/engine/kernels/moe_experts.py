"""Gemma 4's routed experts over stacked weights, through the grouped GEMM.

``expert_mlp(x, choice, gate_up, down)``: x [T, H]; ``choice`` the router's ``RouterChoice``;
``gate_up`` [E, 2I, H] and ``down`` [E, H, I] (each optionally e4m3 with block scales). As
``moe.Experts`` computes it: the ``T * k`` (token, expert) pairs sorted by expert (stable),
each expert's rows through ``down(gelu_tanh(gate) * up)``, the rows weighted and summed back
per token. Both products are one ``grouped_gemm`` launch each; ``backend`` is passed to them.

``use_grouped_experts(model, backend)`` puts every MoE block of a loaded model on this path (the
runner's GPU path): each block's expert weights are stacked once (``stack_experts``) and each
expert's own ``Linear`` / ``FP8Linear`` weight becomes a view of its row of the stack, so the
model holds one copy; the block then calls ``expert_mlp`` (``moe.Experts.grouped``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from chatfleet.engine.kernels.grouped_gemm import grouped_gemm
from chatfleet.engine.models.fp8_linear import FP8Linear
from chatfleet.engine.models.linear import Linear
from chatfleet.engine.models.moe import Experts, GatedMLP, RouterChoice


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


def _stack(projections: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int] | None] | None:
    """One projection of every expert as a stack (weights, block scales, block), each expert's
    tensors rebound to views of it; None where the layers cannot be stacked (oneDNN-packed,
    several FP8 parts, per-tensor/channel scales, mixed kinds)."""
    plain = [p.weight for p in projections if isinstance(p, Linear) and p.weight is not None]
    if len(plain) == len(projections):
        weights = torch.stack([w.detach() for w in plain])
        for w, row in zip(plain, weights, strict=True):
            w.data = row
        return weights, None, None
    fp8 = [p for p in projections if isinstance(p, FP8Linear) and len(p.part_sizes) == 1
           and p.fmt.granularity == "block"]
    if len(fp8) == len(projections):
        weights = torch.stack([p.part(0)[0] for p in fp8])
        scales = torch.stack([p.part(0)[1] for p in fp8])
        for p, w, sc in zip(fp8, weights, scales, strict=True):
            p.weight_0, p.scale_0 = w, sc  # registered buffers, now views of the stacks
        return weights, scales, fp8[0].fmt.block
    return None


def stack_experts(experts: Experts) -> StackedExperts | None:
    """``experts``' projections stacked (see ``_stack``), or None where they cannot be."""
    mlps = [cast(GatedMLP, m) for m in experts.experts]
    gate_up = _stack([m.gate_up_proj for m in mlps])
    down = _stack([m.down_proj for m in mlps]) if gate_up is not None else None
    if gate_up is None or down is None or gate_up[2] != down[2]:
        return None
    return StackedExperts(gate_up[0], down[0], gate_up[1], down[1], gate_up[2])


def use_grouped_experts(model: nn.Module, backend: str | None) -> int:
    """Every MoE block of ``model`` through ``expert_mlp`` with ``backend`` (None: back to each
    block's own loop); returns how many blocks take it."""
    count = 0
    for module in model.modules():
        if not isinstance(module, Experts):
            continue
        module.grouped = None
        if backend is None:
            continue
        stacked = stack_experts(module)
        if stacked is not None:
            module.grouped = partial(expert_mlp, experts=stacked, backend=backend)
            count += 1
    return count

