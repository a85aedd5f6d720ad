"""Step-cost model: the virtual seconds one engine step takes on a GPU, from its plan.

A roofline per step (the batch is one forward pass):

- bytes: every weight once (the embedding table excepted: only its rows are gathered) + for each
  scheduled chunk the KV of its context read once (sliding layers: their window) and its new
  tokens' KV written;
- FLOPs: ``2 x linear params`` per scheduled token (MoE: the active experts' share) + attention,
  ``4 x query width`` per layer per (token, context token) pair, windows applied;
- time = ``step_overhead + max(FLOPs / (peak x compute), bytes / (bandwidth x memory))
  + transfer bytes / (PCIe x pcie)``, the efficiencies from the catalog entry (``Efficiency``).
  Host-tier transfers run before the forward pass (as the runner does), so they add.

Coarse time (``token_scale=k`` > 1): each simulated token stands for ``k`` real ones and one
simulated step for ``k`` real steps, each scheduling the chunk's token count at positions ``k``
times further on (``plan/replica_setup.py`` scales the workload, pool and budgets to match);
the step costs ``k`` real steps, its transfers once (a simulated block holds ``k`` real blocks).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chatfleet.engine.outputs import SchedulerOutput
from chatfleet.engine.sizing.memory import MemoryBreakdown
from chatfleet.plan.catalog import Efficiency, GpuSpec


@dataclass(frozen=True)
class GroupCost:
    num_layers: int
    kv_bytes_per_token_per_layer: int
    window: int | None
    block_bytes: int  # one block of this group, all its layers


@dataclass(frozen=True)
class ModelCost:
    """What one step of a model costs, independent of the GPU."""

    weight_bytes_per_step: int
    linear_flops_per_token: float
    query_width: int  # attention heads x head dim
    groups: tuple[GroupCost, ...]
    weights_precision: str  # "fp8" or "bf16" (which tensor rate applies)

    @classmethod
    def from_breakdown(cls, b: MemoryBreakdown, config: Mapping[str, Any]) -> ModelCost:
        nested = config.get("text_config")
        text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
        heads = int(text.get("num_attention_heads") or 1)
        head_dim = int(text.get("head_dim") or int(text.get("hidden_size") or heads) // heads)
        linear = {c.tensor_class: c.num_params for c in b.classes if not c.skipped}
        experts = linear.get("experts", 0)
        total_experts = int(text.get("num_experts") or text.get("num_local_experts") or 0)
        active = int(text.get("num_experts_per_tok") or 0)
        if experts and total_experts and active:
            experts = experts * active // total_experts
        head = linear.get("lm_head") or (linear.get("embedding", 0) if b.tie_word_embeddings else 0)
        flops = 2.0 * (linear.get("attention", 0) + linear.get("mlp", 0) + experts + head)
        weight_bytes = b.weight_bytes - (0 if b.tie_word_embeddings else b.bytes_of("embedding"))
        groups = tuple(GroupCost(g.num_layers, g.bytes_per_token_per_layer, g.sliding_window, g.bytes_per_block)
                       for g in b.kv_spec.groups)
        precision = "fp8" if b.weights_format.startswith("fp8") else "bf16"
        return cls(weight_bytes, flops, heads * head_dim, groups, precision)


@dataclass(frozen=True)
class StepCost:
    compute_s: float
    memory_s: float
    transfer_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return _total(self.compute_s, self.memory_s, self.transfer_s, self.overhead_s)


def _total(compute_s: float, memory_s: float, transfer_s: float, overhead_s: float) -> float:
    """A step's seconds from its parts (the roofline: compute and memory overlap)."""
    return overhead_s + max(compute_s, memory_s) + transfer_s


class StepCostModel:
    """``model(plan) -> seconds``: what ``SimRunner(cost_model=...)`` charges per step."""

    def __init__(self, model: ModelCost, gpu: GpuSpec, efficiency: Efficiency | None = None,
                 token_scale: int = 1) -> None:
        if token_scale < 1:
            raise ValueError("token_scale must be >= 1")
        self.token_scale = token_scale
        self.model = model
        self.gpu = gpu
        self.eff = efficiency or gpu.efficiency
        self._flops = gpu.flops_per_s(model.weights_precision) * self.eff.compute
        self._bw = gpu.bandwidth_bytes_per_s * self.eff.memory
        self._pcie = gpu.pcie_bytes_per_s * self.eff.pcie
        # batch_cost's closed form (per step of a simulation): exact time, full attention only
        self._closed_form = token_scale == 1 and all(g.window is None for g in model.groups)
        self._kv_bytes_per_token = sum(g.num_layers * g.kv_bytes_per_token_per_layer for g in model.groups)
        self._attn_layers = sum(g.num_layers for g in model.groups)

    def cost(self, plan: SchedulerOutput) -> StepCost:
        m, k = self.model, self.token_scale
        tokens = 0
        kv_bytes = 0.0
        attn_pairs = 0.0  # sum over layers of (token, context token) pairs
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            # coarse time: the k real steps' average start position (exact for k == 1)
            start = chunk.start_position * k + (k - 1) * n / 2
            end = start + n
            tokens += n
            for g in m.groups:
                read = end if g.window is None else min(end, g.window + n)
                kv_bytes += g.num_layers * g.kv_bytes_per_token_per_layer * (read + n)
                # token i (start <= i < end) attends to i + 1 positions (its window at most)
                pairs = n * (start + end + 1) / 2 if g.window is None else n * min((start + end + 1) / 2, g.window)
                attn_pairs += g.num_layers * pairs
        moved = 0
        if plan.kv_transfers:
            block = sum(g.block_bytes for g in m.groups)
            moved = sum(t.num_blocks for t in plan.kv_transfers) * block * k
        return self._step_cost(tokens, kv_bytes, attn_pairs, moved)

    def _step_cost(self, tokens: int, kv_bytes: float, attn_pairs: float, moved: int) -> StepCost:
        return StepCost(*self._parts(tokens, kv_bytes, attn_pairs, moved))

    def _parts(self, tokens: int, kv_bytes: float, attn_pairs: float, moved: int) -> tuple[float, float, float, float]:
        """Compute, memory, transfer and overhead seconds of a step (``StepCost``'s fields)."""
        m, k = self.model, self.token_scale
        flops = tokens * m.linear_flops_per_token + 4.0 * m.query_width * attn_pairs
        return (k * flops / self._flops, k * (m.weight_bytes_per_step + kv_bytes) / self._bw,
                moved / self._pcie, k * self.eff.step_overhead_ms / 1e3)

    def __call__(self, plan: SchedulerOutput) -> float:
        return self.cost(plan).total_s

    def decode_cost(self, num_requests: int, sum_starts: int) -> float | None:
        """What ``self(plan)`` charges for a plan of ``num_requests`` one-token chunks whose start
        positions sum to ``sum_starts`` (no transfers), in O(1): the per-chunk sums of ``cost``
        are sums of whole numbers, exact in floating point below 2**53, so this is the same
        float. None where it cannot say (sliding windows, coarse time, sums past 2**53)."""
        return self.batch_cost(num_requests, sum_starts, ())

    def batch_cost(self, num_decodes: int, sum_starts: int, chunks: Sequence[tuple[int, int]]) -> float | None:
        """``decode_cost`` plus longer ``chunks`` (start position, tokens) in the same step (a
        prefill beside the decodes): their terms of ``cost`` are whole or half numbers, so the
        sums are exact in any order and this is again the same float as ``self(plan)``."""
        if not self._closed_form:
            return None
        # per decode chunk (n = 1, start s, end s + 1): KV read s + 1 and written 1; pairs s + 1
        kv_tokens = sum_starts + 2 * num_decodes
        twice_pairs = 2 * (sum_starts + num_decodes)
        tokens = num_decodes
        for start, n in chunks:  # KV read start + n, written n; pairs n * (2 * start + n + 1) / 2
            kv_tokens += start + 2 * n
            twice_pairs += n * (2 * start + n + 1)
            tokens += n
        kv_bytes = self._kv_bytes_per_token * kv_tokens
        twice_pairs *= self._attn_layers
        if kv_bytes >= 2**53 or twice_pairs >= 2**53:
            return None
        # ``_step_cost(...).total_s`` without building the record (once per simulated step)
        return _total(*self._parts(tokens, float(kv_bytes), twice_pairs / 2, 0))
