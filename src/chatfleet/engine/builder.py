"""The parts an ``Engine`` runs on, built from its config: model, memory plan, KV manager, runner.

``build_engine_parts`` loads the model (unless a runner is injected: the planner's and tests'
``SimRunner``), sizes the KV pool(s) by the memory arithmetic, picks the KV manager (one pool, or
a pool per layer group: ``kv/hybrid.py``), makes the runner and settles the context length.
The result is a value; ``Engine`` takes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from chatfleet.engine.config import EngineConfig, SchedulerConfig, engine_memory
from chatfleet.engine.kv.base import KVManager
from chatfleet.engine.kv.hybrid import HybridKVManager
from chatfleet.engine.kv.manager import PagedKVManager
from chatfleet.engine.kv.spec import KVCacheSpec, PoolPlan
from chatfleet.engine.memory_check import check_kv_fits
from chatfleet.engine.runner.base import Runner
from chatfleet.engine.sizing.config_readers import has_config_reader
from chatfleet.engine.sizing.gpu_budget import GpuMemoryPlan, usable_bytes
from chatfleet.engine.sizing.memory import MemoryBreakdown
from chatfleet.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["EngineParts", "build_engine_parts"]


@dataclass(frozen=True)
class EngineParts:
    """What an engine is made of, settled from its config (``build_engine_parts``)."""

    runner: Runner
    tokenizer: Any  # a ChatTokenizer, or a stand-in with the same reads (the planner's NullTokenizer)
    kv: KVManager
    scheduler_config: SchedulerConfig  # the config's, with a budget the KV pools can serve
    max_model_len: int
    vocab_size: int
    kv_spec: KVCacheSpec | None = None  # None for an injected runner
    pool_plan: PoolPlan | None = None
    memory: MemoryBreakdown | None = None  # weights by class, KV per token, pool (memory arithmetic)


@dataclass(frozen=True)
class _LoadedRunner:
    runner: Runner
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    kv_spec: KVCacheSpec
    pool_plan: PoolPlan
    memory: MemoryBreakdown | None


def build_engine_parts(
    config: EngineConfig,
    *,
    runner: Runner | None = None,
    tokenizer: Any = None,
    clock: Callable[[], float] = time.monotonic,
) -> EngineParts:
    """The engine's parts: the model's runner loaded per ``config`` unless ``runner`` is given
    (then ``tokenizer`` must be too), the KV manager over the runner's pool(s)."""
    loaded: _LoadedRunner | None = None
    model_max_len: int | None = None
    vocab_size: int | None = getattr(runner, "vocab_size", None)
    if runner is None:
        loaded = _load_runner(config)
        runner, model_max_len, vocab_size = loaded.runner, loaded.max_model_len, loaded.vocab_size
        tokenizer = tokenizer or loaded.tokenizer
    elif tokenizer is None:
        raise ConfigError("an Engine given a runner needs a tokenizer too")
    model_max_len = model_max_len or getattr(runner, "max_model_len", None)
    block_size = getattr(runner, "block_size", config.cache.block_size)
    if block_size != config.cache.block_size:
        raise ConfigError(f"runner block size {block_size} != configured {config.cache.block_size}")
    max_model_len = _max_model_len(config, model_max_len, runner, block_size)
    pool_plan = loaded.pool_plan if loaded is not None else None
    scheduler_config = config.scheduler
    kv: KVManager
    if pool_plan is not None and len(pool_plan.pools) > 1:
        hybrid = HybridKVManager(
            pool_plan,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            eviction_policy=config.cache.eviction_policy,
            keep_slid_out_blocks=config.cache.keep_slid_out_blocks,
            clock=clock,
        )
        fit = hybrid.max_step_tokens()
        if fit < scheduler_config.max_batched_tokens:
            log.warning("max_batched_tokens %d -> %d: what the sliding-window KV pool holds in one step",
                        scheduler_config.max_batched_tokens, fit)
            scheduler_config = replace(scheduler_config, max_batched_tokens=fit)
        kv = hybrid
    else:
        kv = PagedKVManager(
            runner.num_blocks,
            block_size,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            eviction_policy=config.cache.eviction_policy,
            num_host_blocks=getattr(runner, "num_host_blocks", 0),
            host_eviction_policy=config.cache.host_eviction_policy,
            clock=clock,
        )
    return EngineParts(
        runner=runner, tokenizer=tokenizer, kv=kv, scheduler_config=scheduler_config,
        max_model_len=max_model_len, vocab_size=vocab_size or tokenizer.vocab_size,
        kv_spec=loaded.kv_spec if loaded is not None else None, pool_plan=pool_plan,
        memory=loaded.memory if loaded is not None else None,
    )


def _max_model_len(config: EngineConfig, model_max_len: int | None, runner: Runner, block_size: int) -> int:
    """The configured context length (at most the model's), else the model's capped by what the
    runner's pool can ever hold."""
    if config.max_model_len is not None:
        if model_max_len is not None and config.max_model_len > model_max_len:
            raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's {model_max_len}")
        return config.max_model_len
    if model_max_len is None:
        raise ConfigError("cannot tell the model's context length; set max_model_len")
    return min(model_max_len, runner.num_blocks * block_size)


def _load_runner(config: EngineConfig) -> _LoadedRunner:
    """Load the model, plan its KV memory (device pool(s), host tier), check it fits, make the
    torch runner."""
    from chatfleet.engine.runner.device import resolve_device_name
    from chatfleet.engine.runner.torch_runner import TorchRunner

    utilization = config.gpu_memory_utilization
    config = replace(config, device=resolve_device_name(config.device), gpu_memory_utilization=None)
    if config.dtype == "auto":
        config = replace(config, dtype=_auto_dtype(config))
    loaded = _load_model(config)
    memory: MemoryBreakdown | None = None
    gpu_plan: GpuMemoryPlan | None = None
    if utilization is not None:
        config, gpu_plan = _size_pool_for_gpu(config, loaded, utilization)
    if has_config_reader(loaded.hf_config):
        memory = engine_memory(config, loaded.hf_config)
        if gpu_plan is not None:  # the start-up table shows the card's split
            memory = replace(memory, budget_bytes=usable_bytes(gpu_plan.total_bytes, gpu_plan.utilization, 0),
                             reserved_bytes=gpu_plan.activation_bytes)
            log.info("%s", gpu_plan.describe())
        kv_spec, pool_plan = memory.kv_spec, memory.pool
        assert pool_plan is not None
        log.info("%s", memory.describe())
    else:  # a model type the memory arithmetic does not know yet: the model's own spec
        kv_spec = loaded.config.kv_cache_spec(config.cache.block_size, config.resolved_kv_cache_dtype)
        pool_plan = config.cache.plan_pools(kv_spec)
        log.info("%s", pool_plan.describe())
    num_blocks: int | dict[str, int] = pool_plan.pools[0].num_blocks
    if len(kv_spec.groups) > 1:  # a pool per layer group (kv/hybrid.py)
        if config.cache.host_memory_bytes:
            raise ConfigError("the host cache tier is not supported for models with several KV layer groups")
        num_blocks = {p.group.name: p.num_blocks for p in pool_plan.pools}
        log.info("%s", pool_plan.describe())
    host_plan = config.cache.plan_host_pools(kv_spec)
    num_host_blocks = host_plan.pools[0].num_blocks if host_plan is not None else 0
    if host_plan is not None:
        log.info("host tier: %s", host_plan.describe())
    check_kv_fits(pool_plan.num_bytes, host_plan.num_bytes if host_plan else 0, config.device)
    runner = TorchRunner(loaded, num_blocks, config.cache.block_size, config.device, seed=config.seed,
                         num_host_blocks=num_host_blocks, kv_cache_dtype=config.kv_cache_dtype,
                         kv_scales_from_prompts=config.kv_scales_from_prompts,
                         enforce_eager=config.enforce_eager, max_decode_batch=config.scheduler.max_running,
                         decode_kernel=config.decode_kernel)
    if runner.graphs is not None:
        start = time.perf_counter()
        sizes = runner.capture_graphs()
        log.info("CUDA graphs: %d decode batch sizes captured (%s) in %.1f s%s", len(sizes),
                 ", ".join(map(str, sizes)), time.perf_counter() - start,
                 "" if runner.graphs.enabled else "; capture failed, decode steps run eagerly")
    return _LoadedRunner(runner, loaded.tokenizer, loaded.max_model_len, loaded.config.vocab_size,
                         kv_spec, pool_plan, memory)


def _size_pool_for_gpu(config: EngineConfig, loaded: Any, utilization: float) -> tuple[EngineConfig, GpuMemoryPlan]:
    """``--gpu-memory-utilization``: profile a step at the budget, give the KV pool the rest of
    that share of the card (engine/sizing/gpu_budget.py); the config then names the pool's bytes."""
    import torch

    from chatfleet.engine.runner import memory_profile

    if not has_config_reader(loaded.hf_config):
        raise ConfigError("--gpu-memory-utilization needs the memory arithmetic for this model type; "
                          "size the pool with --kv-cache-memory")
    device = torch.device(config.device)
    probe = memory_profile.probe_for(device)
    tokens = min(config.scheduler.max_batched_tokens, loaded.max_model_len)
    activations = memory_profile.profile_activation_peak(
        loaded.model, tokens, config.scheduler.max_running, loaded.config.vocab_size, device, probe)
    weights = engine_memory(config, loaded.hf_config).weight_bytes
    plan = GpuMemoryPlan(config.device, probe.total_bytes(), utilization, weights, activations, tokens).check()
    return replace(config, cache=replace(config.cache, memory_bytes=plan.kv_bytes)), plan


def _auto_dtype(config: EngineConfig) -> str:
    """What ``--dtype auto`` means for this model on the (resolved) device."""
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.dtype import dtype_for_auto

    folder = resolve_model(config.model) if config.device.startswith("cuda") else None
    dtype = dtype_for_auto(config.device, folder)
    log.info("--dtype auto: %s on %s", dtype, config.device)
    return dtype


def _load_model(config: EngineConfig) -> Any:
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model

    if config.num_threads is not None:
        import torch

        torch.set_num_threads(config.num_threads)
    return load_model(resolve_model(config.model), dtype=config.dtype, device=config.device,
                      kernels=config.kernels, quantization=config.quantization,
                      embedding_dtype=config.embedding_dtype,
                      language_model_only=config.language_model_only)
