"""The profile pass behind ``--gpu-memory-utilization``: one forward at the step budget, before
the KV pool exists, measuring the activation peak above what is already allocated (weights).

The step's tokens run as one causal sequence (no paged cache: the pool is not allocated yet),
then logits for ``logit_rows`` of them, as a step of the budget computes. ``MemoryProbe`` is
what the pass reads memory through: ``CudaMemoryProbe`` on a GPU; a test gives its own.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from chatfleet.errors import ConfigError


class MemoryProbe(Protocol):
    def total_bytes(self) -> int: ...

    def start(self) -> int:
        """Synchronize, reset the peak counter, return the bytes allocated now."""
        ...

    def peak_bytes(self) -> int:
        """Synchronize, return the most bytes allocated since ``start``."""
        ...


class CudaMemoryProbe:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def total_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device)[1])

    def start(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def peak_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        peak = int(torch.cuda.max_memory_allocated(self.device))
        torch.cuda.empty_cache()  # the pool's free-memory check then sees the profile's blocks free
        return peak


def probe_for(device: torch.device) -> MemoryProbe:
    if device.type != "cuda":
        raise ConfigError(f"--gpu-memory-utilization needs a CUDA device; this engine runs on {device}")
    return CudaMemoryProbe(device)


def profile_activation_peak(model: nn.Module, num_tokens: int, logit_rows: int, vocab_size: int,
                            device: torch.device, probe: MemoryProbe) -> int:
    """Bytes a step of ``num_tokens`` tokens allocates above what is allocated before it."""
    base = probe.start()
    with torch.inference_mode():
        ids = torch.randint(0, vocab_size, (num_tokens,), device=device)
        positions = torch.arange(num_tokens, device=device)
        hidden = model(ids, positions, None, None)
        model.compute_logits(hidden[-max(1, min(logit_rows, num_tokens)):])  # type: ignore[operator]
        del hidden
    return max(0, probe.peak_bytes() - base)
