"""Frozen, validated engine configuration. CLI flags take their defaults from here."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from chatfleet.engine.device import check_device_name
from chatfleet.engine.kv.eviction_policies import EVICTION_POLICIES
from chatfleet.engine.kv.spec import KVCacheSpec, PoolPlan
from chatfleet.engine.models.backends import DECODE_KERNELS, KERNEL_BACKENDS
from chatfleet.engine.scheduling_policy import SCHEDULING_POLICIES
from chatfleet.engine.sizing.memory import MemoryBreakdown, memory_breakdown
from chatfleet.errors import ConfigError


def parse_memory_size(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' (bytes) -> bytes. A bare float < 1024 means GiB."""
    if isinstance(value, (int, float)):
        return int(value * (1 << 30)) if isinstance(value, float) and value < 1024 else int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|[KMGT]|B)?\s*", value, re.IGNORECASE)
    if not m:
        raise ConfigError(f"cannot parse memory size {value!r}; use e.g. '2GiB', '512MiB' or bytes")
    number, unit = float(m.group(1)), (m.group(2) or "").upper()
    if not unit:
        return int(number * (1 << 30)) if "." in m.group(1) or number < 1024 else int(number)
    scale = {"B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit[0]]
    if unit in ("KB", "MB", "GB", "TB"):
        scale = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[unit[0]]
    return int(number * scale)


# auto: bfloat16 on a CPU that computes it natively, else float32; on CUDA the checkpoint's
# torch_dtype (models/dtype.py; resolved when the engine loads the model, like --device auto).
MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")  # auto: the model's dtype; fp8: e4m3
QUANTIZATIONS = ("fp8",)  # --quantization: quantize a 16/32-bit checkpoint's linears at load
EMBEDDING_DTYPES = ("auto", "fp8")  # auto: the model's dtype; fp8: one table, per-row scales
DEFAULT_KV_CACHE_TOKENS = 65536  # pool size when neither tokens nor memory is given


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_tokens: int | None = None  # --kv-cache-tokens
    memory_bytes: int | None = None  # --kv-cache-memory
    enable_prefix_caching: bool = True
    eviction_policy: str = "lru"  # device pool (kv/eviction.py registry)
    host_memory_bytes: int = 0  # --host-cache-memory: the host tier (0: none)
    host_eviction_policy: str = "lru"
    # Models with sliding-window and full-attention layer groups (kv/hybrid.py):
    sliding_memory_fraction: float | None = None  # --sliding-memory-fraction (None: from the spec)
    keep_slid_out_blocks: bool = True  # blocks that slid out of the window stay cached for the next turn

    def __post_init__(self) -> None:
        EVICTION_POLICIES.check(self.eviction_policy)
        EVICTION_POLICIES.check(self.host_eviction_policy)
        if self.host_memory_bytes < 0:
            raise ConfigError("host cache memory must be >= 0")
        if self.host_memory_bytes and not self.enable_prefix_caching:
            raise ConfigError("the host cache tier needs prefix caching (it holds cached blocks)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_tokens is not None and self.memory_bytes is not None:
            raise ConfigError("give either --kv-cache-tokens or --kv-cache-memory, not both")
        if self.num_tokens is not None and self.num_tokens < self.block_size:
            raise ConfigError(f"kv cache must hold at least one block ({self.block_size} tokens)")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ConfigError("kv cache memory must be positive")
        if self.sliding_memory_fraction is not None and not 0.0 < self.sliding_memory_fraction < 1.0:
            raise ConfigError(f"sliding_memory_fraction must be in (0, 1), got {self.sliding_memory_fraction}")

    def plan_pools(self, spec: KVCacheSpec, default_tokens: int = DEFAULT_KV_CACHE_TOKENS) -> PoolPlan:
        """The device pools this config buys for a model's KV spec (``kv/spec.py``)."""
        if self.memory_bytes is not None:
            return spec.plan_pools(memory_bytes=self.memory_bytes, memory_fractions=self.memory_fractions(spec))
        return spec.plan_pools(num_tokens=self.num_tokens if self.num_tokens is not None else default_tokens)

    def memory_fractions(self, spec: KVCacheSpec) -> dict[str, float] | None:
        """The split between layer groups ``sliding_memory_fraction`` asks for (None: the spec's
        default, in proportion to what one long request needs per group)."""
        if self.sliding_memory_fraction is None or len(spec.groups) == 1:
            return None
        sliding = [g for g in spec.groups if g.is_sliding]
        full = [g for g in spec.groups if not g.is_sliding]
        if len(sliding) != 1 or len(full) != 1:
            raise ConfigError("--sliding-memory-fraction needs exactly one sliding and one full layer group")
        return {sliding[0].name: self.sliding_memory_fraction, full[0].name: 1.0 - self.sliding_memory_fraction}

    def plan_host_pools(self, spec: KVCacheSpec) -> PoolPlan | None:
        """The host-tier pools ``host_memory_bytes`` buys (None without a host tier)."""
        if not self.host_memory_bytes:
            return None
        return spec.plan_pools(memory_bytes=self.host_memory_bytes)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batched_tokens: int = 2048  # per-step token budget
    # --mixed-step-tokens: the budget of a step that carries decode rows (prompt chunks beside them
    # are cut to fit; the decodes themselves always run); None: max_batched_tokens. Short mixed
    # steps keep running replies' inter-token time low (Sarathi-Serve's stall-free batching) and,
    # on the CPU, every step inside the decode stack's rows (Scheduler.step_budget).
    mixed_step_tokens: int | None = None
    max_running: int = 256  # concurrency cap: requests in the batch
    max_waiting: int = 1024  # bounded waiting queue; beyond it: 503
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"  # --scheduling-policy (engine/scheduling_policy.py registry)
    max_queue_delay: float = 10.0  # --max-queue-delay: a request waiting longer goes first (lpm)
    lpm_host_weight: float = 0.5  # a host-tier hit token counts this much of a device hit (lpm)

    def __post_init__(self) -> None:
        SCHEDULING_POLICIES.check(self.policy)
        if not self.max_queue_delay >= 0:
            raise ConfigError(f"max_queue_delay must be >= 0 seconds, got {self.max_queue_delay}")
        if not 0.0 <= self.lpm_host_weight <= 1.0:
            raise ConfigError(f"lpm_host_weight must be in [0, 1], got {self.lpm_host_weight}")
        if self.max_batched_tokens < 1:
            raise ConfigError("max_batched_tokens must be >= 1")
        if self.mixed_step_tokens is not None and self.mixed_step_tokens < 1:
            raise ConfigError("mixed_step_tokens must be >= 1")
        if self.max_running < 1:
            raise ConfigError("max_running must be >= 1")
        if self.max_waiting < 0:
            raise ConfigError("max_waiting must be >= 0")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # a local HF folder, or the built-in names 'tiny' / 'small'
    served_model_name: str | None = None
    dtype: str = "float32"
    device: str = "auto"  # --device auto|cpu|cuda[:N] (auto: CUDA when present; engine/device.py)
    kernels: str = "auto"  # model kernels: auto (oneDNN on CPU where available), onednn, torch
    decode_kernel: str = "auto"  # CPU decode attention: auto (cpp where it builds), cpp, torch
    seed: int = 0
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_threads: int | None = None  # torch intra-op threads; None: leave as is
    # Precision (see engine/sizing/memory.py for what each costs):
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype
    kv_scales_from_prompts: int | None = None  # FP8 cache: measure K/V scales from the first N prompt tokens
    quantization: str | None = None  # --quantization fp8 (None: as the checkpoint is)
    embedding_dtype: str = "auto"  # --embedding-dtype
    # A multimodal checkpoint's vision/audio towers are never read (no image or audio input is served).
    language_model_only: bool = True  # --language-model-only / --no-language-model-only
    # On a GPU (engine/sizing/gpu_budget.py): this share of the card for weights + activations +
    # KV, the KV pool getting what a profile pass at the step budget leaves; None: size the pool
    # by the cache config's tokens or bytes.
    gpu_memory_utilization: float | None = None  # --gpu-memory-utilization
    enforce_eager: bool = False  # --enforce-eager: no CUDA graphs for decode steps
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(MODEL_DTYPES)}; got {self.dtype!r}")
        check_device_name(self.device)
        if self.gpu_memory_utilization is not None:
            if not 0.0 < self.gpu_memory_utilization <= 1.0:
                raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
            if self.device == "cpu":
                raise ConfigError("--gpu-memory-utilization needs a GPU device; on the CPU size the pool with "
                                  "--kv-cache-memory or --kv-cache-tokens")
            if self.cache.num_tokens is not None or self.cache.memory_bytes is not None:
                raise ConfigError("give --gpu-memory-utilization or a KV pool size (--kv-cache-tokens, "
                                  "--kv-cache-memory), not both")
        if self.kernels not in KERNEL_BACKENDS:
            raise ConfigError(f"unknown kernel backend {self.kernels!r}; valid: {', '.join(KERNEL_BACKENDS)}")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ConfigError(f"unknown decode kernel {self.decode_kernel!r}; valid: {', '.join(DECODE_KERNELS)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"unknown KV cache dtype {self.kv_cache_dtype!r}; valid: {', '.join(KV_CACHE_DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"unknown quantization {self.quantization!r}; valid: {', '.join(QUANTIZATIONS)}")
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ConfigError(f"unknown embedding dtype {self.embedding_dtype!r}; valid: {', '.join(EMBEDDING_DTYPES)}")
        if self.kv_scales_from_prompts is not None:
            if self.kv_scales_from_prompts < 1:
                raise ConfigError("kv_scales_from_prompts must be >= 1 tokens")
            if self.resolved_kv_cache_dtype != "fp8":
                raise ConfigError("--kv-scales-from-prompts needs --kv-cache-dtype fp8")

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV cache's dtype name (``auto`` resolved to the model's dtype)."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


def engine_memory(config: EngineConfig, hf_config: Mapping[str, Any]) -> MemoryBreakdown:
    """The engine's memory breakdown (engine/sizing/memory.py) with the pool its cache config buys."""
    memory = memory_breakdown(hf_config, dtype=config.dtype, quantization=config.quantization,
                              embedding_dtype=config.embedding_dtype, kv_cache_dtype=config.kv_cache_dtype,
                              block_size=config.cache.block_size, language_model_only=config.language_model_only)
    return replace(memory, pool=config.cache.plan_pools(memory.kv_spec))
