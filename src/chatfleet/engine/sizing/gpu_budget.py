"""A card's memory split as a GPU engine splits it (``--gpu-memory-utilization``), torch-free.

``usable_bytes(total, fraction, reserve)``: what a replica may spend on weights and its KV pool:
``fraction`` of the card less a ``reserve`` (activations at the step budget, measured by the
engine's profile pass; the planner's ``--reserve``). The engine sizes its pool with it (weights
by the memory arithmetic, the reserve profiled) and the planner predicts with it (``plan
memory --memory-fraction``), so the two agree for the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatfleet.errors import ConfigError

MiB = 1 << 20


def usable_bytes(total_bytes: int, fraction: float, reserve_bytes: int) -> int:
    """``fraction`` of ``total_bytes`` less ``reserve_bytes``: the bytes for weights + KV pool."""
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"memory fraction must be in (0, 1], got {fraction}")
    if reserve_bytes < 0:
        raise ConfigError(f"a memory reserve cannot be negative, got {reserve_bytes}")
    return int(fraction * total_bytes) - reserve_bytes


@dataclass(frozen=True)
class GpuMemoryPlan:
    """One engine's split of its card: the KV pool gets what weights and activations leave."""

    device: str
    total_bytes: int
    utilization: float
    weight_bytes: int  # the memory arithmetic's (engine/sizing/memory.py)
    activation_bytes: int  # the profile pass's peak above the weights
    profiled_tokens: int  # the step budget the profile pass ran at

    @property
    def budget_bytes(self) -> int:
        """Weights + KV pool: ``usable_bytes`` with the activations as the reserve."""
        return usable_bytes(self.total_bytes, self.utilization, self.activation_bytes)

    @property
    def kv_bytes(self) -> int:
        return self.budget_bytes - self.weight_bytes

    def check(self) -> GpuMemoryPlan:
        if self.kv_bytes <= 0:
            raise ConfigError(
                f"--gpu-memory-utilization {self.utilization:g} of {self.device}'s {self.total_bytes / MiB:,.0f} MiB "
                f"leaves no KV pool: weights {self.weight_bytes / MiB:,.1f} MiB and activations "
                f"{self.activation_bytes / MiB:,.1f} MiB (at {self.profiled_tokens} tokens a step); raise it or "
                "lower --max-batched-tokens")
        return self

    def describe(self) -> str:
        return (f"GPU memory: {self.utilization:g} x {self.total_bytes / MiB:,.0f} MiB ({self.device}) = weights "
                f"{self.weight_bytes / MiB:,.1f} MiB + activations {self.activation_bytes / MiB:,.1f} MiB "
                f"(profiled at {self.profiled_tokens} tokens) + KV pool {self.kv_bytes / MiB:,.1f} MiB")
