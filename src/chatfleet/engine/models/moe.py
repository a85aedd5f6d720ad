"""Mixture-of-experts feed-forward for CPU: a router, then tokens grouped by expert.

``Router(x) -> RouterChoice``: the top-k experts of every token and their weights, computed as
``transformers`` computes Gemma 4's router (RMS-normed input times a learned scale and
``hidden**-0.5``, softmax in float32 over all experts, top-k, renormalised to sum 1, times a
learned per-expert scale).

``Experts(x, choice)``: the ``T * k`` (token, expert) pairs are sorted by expert (one stable
sort), the hidden states gathered in that order, and each *active* expert runs one matrix
product over its contiguous slice of rows; the weighted rows are summed back per token with one
``index_add_``. The Python loop runs over experts that received tokens, never over tokens.

Each expert's weights are two ordinary ``Linear`` modules (``gate_up_proj`` [2I, H] and
``down_proj`` [H, I]), not one 3-D tensor: whatever a ``Linear`` can be (oneDNN-prepacked, or
FP8 with per-block scales where the FP8 linear replaces it) an expert's projections can be too.
The loader slices the checkpoint's ``[E, 2I, H]`` / ``[E, H, I]`` tensors into them.

On the GPU path the runner gives the block a ``grouped`` function (``kernels/moe_experts.py``:
the experts' weights stacked, each expert's own weights then views into the stacks, and one
grouped GEMM launch per projection); ``Experts`` then calls it instead of its loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chatfleet.engine.models.linear import Linear


@dataclass(frozen=True)
class RouterChoice:
    """Per token: ``experts`` [T, k] long and their ``weights`` [T, k] float32."""

    experts: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.top_k, self.eps = top_k, eps
        self.proj = Linear(hidden_size, num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(num_experts))
        self.root_size = hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> RouterChoice:
        h = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        h = h * self.scale * self.root_size
        probs = torch.softmax(self.proj(h), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterChoice(experts, weights * self.per_expert_scale[experts])


class GatedMLP(nn.Module):
    """A gated feed-forward block, ``down(gelu_tanh(gate) * up)``: one expert, or Gemma 4's dense MLP."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh").mul_(up))


GroupedExperts = Callable[[torch.Tensor, "RouterChoice"], torch.Tensor]  # (x [T, H], choice) -> [T, H]


class Experts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.experts = nn.ModuleList(GatedMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.grouped: GroupedExperts | None = None  # set: the whole block in one call (see the module doc)

    def forward(self, x: torch.Tensor, choice: RouterChoice) -> torch.Tensor:
        if self.grouped is not None:
            return self.grouped(x, choice)
        top_k = choice.experts.shape[1]
        flat = choice.experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # (token, slot) pairs grouped by expert
        token_of = order // top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, token_of)
        out = torch.empty_like(rows)
        start = 0
        for e, count in enumerate(counts):
            if count:
                out[start : start + count] = self.experts[e](rows[start : start + count])
                start += count
        weighted = (out * choice.weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, weighted)
