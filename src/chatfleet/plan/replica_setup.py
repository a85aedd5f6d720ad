"""From a model's config.json, a GPU and a serving config to a simulated replica (``ReplicaPlan``):
its pool from ``engine/sizing/memory.py`` (as the engine sizes it), its step costs from
``plan/cost_model.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.sizing.memory import MemoryBreakdown, memory_breakdown
from chatfleet.errors import ConfigError
from chatfleet.plan.catalog import Efficiency, GpuSpec
from chatfleet.plan.cost_model import ModelCost, StepCostModel
from chatfleet.plan.sim_bench import ReplicaPlan

WEIGHTS = {"bf16": ("bfloat16", None), "fp16": ("float16", None), "fp32": ("float32", None), "fp8": ("bfloat16", "fp8")}
KV = {"auto": "auto", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "fp8"}


@dataclass(frozen=True)
class ServingConfig:
    """What a replica is configured with (mirrors the engine's flags)."""

    weights: str = "bf16"
    kv: str = "auto"
    budget_bytes: int | None = None  # weights + KV (the pool is what is left)
    kv_cache_bytes: int | None = None  # --kv-cache-memory
    kv_cache_tokens: int | None = None  # --kv-cache-tokens
    host_cache_bytes: int = 0  # --host-cache-memory
    block_size: int = 16
    scheduler: SchedulerConfig = SchedulerConfig()
    eviction_policy: str = "lru"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.kv not in KV:
            raise ConfigError(f"kv must be one of {', '.join(KV)}, got {self.kv!r}")
        if sum(x is not None for x in (self.budget_bytes, self.kv_cache_bytes, self.kv_cache_tokens)) != 1:
            raise ConfigError("size the KV pool by exactly one of: a budget, KV cache memory, KV cache tokens")


def serving_breakdown(config: dict[str, Any], s: ServingConfig) -> MemoryBreakdown:
    dtype, quant = WEIGHTS[s.weights]
    return memory_breakdown(config, dtype=dtype, quantization=quant, kv_cache_dtype=KV[s.kv], block_size=s.block_size,
                            language_model_only=True, budget_bytes=s.budget_bytes, kv_cache_bytes=s.kv_cache_bytes,
                            kv_cache_tokens=s.kv_cache_tokens)


def replica_plan(config: dict[str, Any], gpu: GpuSpec, s: ServingConfig, *, efficiency: Efficiency | None = None,
                 fast: bool = True, token_scale: int = 1) -> ReplicaPlan:
    """The replica the engine would be. ``token_scale`` k > 1 is coarse time (see
    ``cost_model.py``): the simulated engine counts in units of k tokens, so its pool has 1/k
    of the blocks (each holding k real blocks) and 1/k of the context. The per-step token budget
    stays: a simulated step is k real ones, each giving decodes one token and prefill the rest."""
    if token_scale < 1 or token_scale & (token_scale - 1):
        raise ConfigError(f"token scale must be a power of two >= 1, got {token_scale}")
    b = serving_breakdown(config, s)
    assert b.pool is not None
    k = token_scale
    num_blocks = b.pool.pools[0].num_blocks // k  # the engine's pool (one block table for all groups)
    host_blocks = 0
    if s.host_cache_bytes:
        host_blocks = b.kv_spec.plan_pools(memory_bytes=s.host_cache_bytes).pools[0].num_blocks // k
    if num_blocks < 1:
        raise ConfigError(f"the KV pool holds under one block at token scale {k}")
    cache = CacheConfig(block_size=s.block_size, num_tokens=num_blocks * s.block_size,
                        eviction_policy=s.eviction_policy, host_memory_bytes=s.host_cache_bytes)
    sched = s.scheduler
    max_model_len = min(b.max_position_embeddings // k, num_blocks * s.block_size)
    engine = EngineConfig(model="simulated", max_model_len=max_model_len, cache=cache, scheduler=sched)
    cost = StepCostModel(ModelCost.from_breakdown(b, config), gpu, efficiency, token_scale=k)
    return ReplicaPlan(engine, num_blocks, host_blocks, cost, fast, k)
