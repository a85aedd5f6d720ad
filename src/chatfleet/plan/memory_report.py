"""`chatfleet plan memory`: one GPU, one model, one precision -> where the memory goes and how
many chats fit. Everything comes from ``engine/sizing/memory.py`` (the arithmetic the engine uses) and
``engine/kv/spec.py``; this module only picks the budget and adds the chat counts and vLLM's pool.

Budget: ``--budget`` is the bytes for weights and KV cache together (after activations and
runtime overhead); ``--memory-fraction F`` derives it as ``F x memory - reserve`` from the
catalog's memory (``reserve``: activations, CUDA context, allocator slack; 1 GiB by default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chatfleet.engine.kv.spec import PoolPlan
from chatfleet.engine.sizing.gpu_budget import usable_bytes
from chatfleet.engine.sizing.memory import MemoryBreakdown, memory_breakdown
from chatfleet.errors import ConfigError
from chatfleet.plan.capacity import ChatFit, LengthDistribution, fit
from chatfleet.plan.catalog import GpuSpec
from chatfleet.plan.vllm_pool import VllmPool, vllm_pool

PRECISIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "fp8"}
DEFAULT_RESERVE = 1 << 30


def read_model_config(model: str) -> tuple[dict[str, Any], str]:
    """A config.json dict from a file, a model folder, or the built-in 'tiny'/'small'."""
    path = Path(model).expanduser()
    if path.is_file():
        cfg_path = path
    elif path.is_dir():
        cfg_path = path / "config.json"
    else:
        from chatfleet.engine.builtin_models.tiny import SIZES, resolve_model

        if model not in SIZES:
            raise ConfigError(f"model {model!r} is neither a config.json, a model folder, "
                              f"nor one of {', '.join(SIZES)}")
        cfg_path = resolve_model(model) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"no config.json in {path}")
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ConfigError(f"{cfg_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path} is not a JSON object")
    return cfg, str(cfg_path)


def budget_for(gpu: GpuSpec, memory_fraction: float | None, budget: int | None, reserve: int) -> int:
    if memory_fraction is not None and budget is not None:
        raise ConfigError("give --memory-fraction or --budget, not both")
    if budget is not None:
        if budget <= 0:
            raise ConfigError("--budget must be positive")
        return budget
    fraction = 0.9 if memory_fraction is None else memory_fraction
    if not 0 < fraction <= 1:
        raise ConfigError(f"--memory-fraction must be in (0, 1], got {fraction}")
    value = usable_bytes(gpu.memory_bytes, fraction, reserve)  # the engine's --gpu-memory-utilization split
    if value <= 0:
        raise ConfigError(f"{fraction:g} of {gpu.name}'s memory minus a reserve of {reserve / 2**30:.2f} GiB "
                          "leaves nothing")
    return value


@dataclass(frozen=True)
class MemoryReport:
    gpu: GpuSpec
    breakdown: MemoryBreakdown
    lengths: LengthDistribution
    device_fit: ChatFit
    host_pool: PoolPlan | None
    host_fit: ChatFit | None
    vllm: VllmPool

    def describe(self) -> str:
        b, g = self.breakdown, self.gpu
        lines = [f"GPU {g.name}: {g.memory_bytes / 2**30:.1f} GiB ({g.source or 'user catalog'})",
                 b.describe(),
                 f"Live chats ({self.lengths.source}): mean {self.lengths.mean:,.0f} tokens, p95 {self.lengths.p95:,}",
                 f"  device pool: {self.device_fit.chats_at_mean:,} chats at the mean length,"
                 f" {self.device_fit.chats_at_p95:,} at p95 ({self.device_fit.bytes_at_mean / 2**20:.1f} /"
                 f" {self.device_fit.bytes_at_p95 / 2**20:.1f} MiB each, no shared prefixes)"]
        if self.host_pool is not None and self.host_fit is not None:
            tokens = min(p.num_tokens for p in self.host_pool.pools)
            lines.append(f"  host tier: {self.host_pool.num_bytes / 2**30:.2f} GiB, {tokens:,} tokens:"
                         f" {self.host_fit.chats_at_mean:,} chats at the mean length,"
                         f" {self.host_fit.chats_at_p95:,} at p95")
        v = self.vllm
        lines.append(f"vLLM (v1 rules, same KV memory): {v.num_blocks:,} blocks x {v.block_size} in {v.num_groups}"
                     f" group(s) of {v.group_size} layers"
                     + (f" ({v.padding_layers} padding)" if v.padding_layers else "")
                     + f"; KV cache size {v.kv_cache_tokens:,} tokens, max concurrency {v.max_concurrency:.2f}x"
                     f" at {v.max_model_len:,} tokens")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        d = self.breakdown.as_dict()
        d.update(gpu=self.gpu.name, lengths={"source": self.lengths.source, "mean": self.lengths.mean,
                                              "p95": self.lengths.p95},
                 device_chats={"at_mean": self.device_fit.chats_at_mean, "at_p95": self.device_fit.chats_at_p95},
                 host_chats=({"at_mean": self.host_fit.chats_at_mean, "at_p95": self.host_fit.chats_at_p95}
                             if self.host_fit else None),
                 vllm={"num_blocks": self.vllm.num_blocks, "kv_cache_tokens": self.vllm.kv_cache_tokens,
                       "max_concurrency": self.vllm.max_concurrency})
        return d


def memory_report(config: dict[str, Any], gpu: GpuSpec, lengths: LengthDistribution, *, weights: str = "bf16",
                  kv: str = "bf16", budget_bytes: int, host_bytes: int = 0, block_size: int = 16,
                  language_model_only: bool = True) -> MemoryReport:
    if weights not in ("bf16", "fp16", "fp8"):
        raise ConfigError(f"--weights must be bf16, fp16 or fp8, got {weights!r}")
    if kv not in PRECISIONS:
        raise ConfigError(f"--kv must be one of {', '.join(PRECISIONS)}, got {kv!r}")
    dtype = "float16" if weights == "fp16" else "bfloat16"
    b = memory_breakdown(config, dtype=dtype, quantization="fp8" if weights == "fp8" else None,
                         kv_cache_dtype=PRECISIONS[kv], block_size=block_size,
                         language_model_only=language_model_only, budget_bytes=budget_bytes)
    assert b.pool is not None
    device_fit = fit(b.kv_spec, b.kv_pool_bytes, lengths)
    host_pool = b.kv_spec.plan_pools(memory_bytes=host_bytes) if host_bytes > 0 else None
    host_fit = fit(b.kv_spec, host_pool.num_bytes, lengths) if host_pool is not None else None
    max_len = b.max_position_embeddings
    return MemoryReport(gpu, b, lengths, device_fit, host_pool, host_fit,
                        vllm_pool(b.kv_spec, budget_bytes - b.weight_bytes, max_len))
