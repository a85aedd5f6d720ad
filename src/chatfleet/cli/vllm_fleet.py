"""`chatfleet serve --engine vllm`: the same fleet with vLLM's OpenAI server as each engine.

The engine settings (the profile's ``engine:`` section and ``--engine-arg`` flags, read as
``chatfleet engine`` would read them) become their vLLM equivalents:

=================================  ==========================================================
chatfleet                          vLLM
=================================  ==========================================================
prefix cache (``--no-prefix-cache``)  ``--enable-prefix-caching`` / ``--no-enable-prefix-caching``
chunked prefill                    ``--enable-chunked-prefill`` / ``--no-enable-chunked-prefill``
``--max-batched-tokens``           ``--max-num-batched-tokens`` (the step's token budget)
``--max-running``                  ``--max-num-seqs`` (the cap on running requests)
``--kv-cache-dtype``               ``--kv-cache-dtype`` (``fp8*`` as is, else ``auto``)
``--kv-cache-memory``              ``--kv-cache-memory-bytes``
``--host-cache-memory``            ``--kv-offloading-backend native --kv-offloading-size GiB``
``--dtype``                        ``--dtype`` (``auto`` resolved as our engine resolves it)
``--max-model-len``,               the same flags (``--block-size`` only when set)
``--seed``, ``--block-size``,
``--gpu-memory-utilization``,
``--enforce-eager``
``--api-key``                      ``--api-key``
admin routes                       ``VLLM_SERVER_DEV_MODE=1`` (``POST /reset_prefix_cache``)
=================================  ==========================================================

Always on: ``--enable-prompt-tokens-details`` (cached tokens in usage: the gateway's sweeps
verify the flush by it). Settings vLLM has no equivalent for (eviction and scheduling policies,
``--kv-cache-tokens``, ...) are named once on start-up and left out: vLLM evicts LRU and
schedules FCFS. vLLM runs from ``--vllm-python`` (default: ``$CHATFLEET_VLLM_PYTHON``, else
this Python).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.launcher import Fleet, FleetConfig
from chatfleet.errors import ConfigError

VLLM_PYTHON_ENV = "CHATFLEET_VLLM_PYTHON"
ENGINE_KINDS = ("chatfleet", "vllm")
GIB = 1 << 30


def vllm_python(given: str | None = None) -> str:
    return given or os.environ.get(VLLM_PYTHON_ENV) or sys.executable


def vllm_dtype(config: EngineConfig) -> str:
    """The ``--dtype`` vLLM gets: ours as pinned, and ``auto`` resolved as our engine resolves it
    (``models/dtype.py``: bfloat16 on a CPU that computes it natively, where vLLM's own ``auto``
    would take the checkpoint's float32), so both engines compute in the same dtype."""
    if config.dtype != "auto":
        return config.dtype
    from chatfleet.engine.models.dtype import dtype_for_auto  # torch: only when asked to resolve
    from chatfleet.engine.runner.device import resolve_device_name
    folder = Path(config.model)
    return dtype_for_auto(resolve_device_name(config.device), folder if folder.is_dir() else None)


def vllm_flags(config: EngineConfig, api_keys: tuple[str, ...] = ()) -> tuple[list[str], list[str]]:
    """vLLM flags for ``config``, and the chatfleet settings that have no vLLM equivalent."""
    cache, sched = config.cache, config.scheduler
    flags = ["--enable-prefix-caching" if cache.enable_prefix_caching else "--no-enable-prefix-caching",
             "--enable-chunked-prefill" if sched.enable_chunked_prefill else "--no-enable-chunked-prefill",
             "--max-num-batched-tokens", str(sched.max_batched_tokens), "--max-num-seqs", str(sched.max_running),
             "--kv-cache-dtype", config.kv_cache_dtype if config.kv_cache_dtype.startswith("fp8") else "auto",
             "--dtype", vllm_dtype(config), "--seed", str(config.seed), "--enable-prompt-tokens-details"]
    if cache.block_size != CacheConfig().block_size:  # vLLM's own default suits its kernels (CPU: 128)
        flags += ["--block-size", str(cache.block_size)]
    if config.max_model_len is not None:
        flags += ["--max-model-len", str(config.max_model_len)]
    if cache.memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(cache.memory_bytes)]
    if cache.host_memory_bytes:
        flags += ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{cache.host_memory_bytes / GIB:g}"]
    if config.gpu_memory_utilization is not None:
        flags += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    if config.enforce_eager:
        flags.append("--enforce-eager")
    for key in api_keys:
        flags += ["--api-key", key]
    plain, plain_cache, plain_sched = EngineConfig(), CacheConfig(), SchedulerConfig()
    dropped = [name for name, value, default in (
        ("--kv-cache-tokens", cache.num_tokens, plain_cache.num_tokens),
        ("--eviction-policy", cache.eviction_policy, plain_cache.eviction_policy),
        ("--host-eviction-policy", cache.host_eviction_policy, plain_cache.host_eviction_policy),
        ("--scheduling-policy", sched.policy, plain_sched.policy),
        ("--max-waiting", sched.max_waiting, plain_sched.max_waiting),
        ("--quantization", config.quantization, plain.quantization),
        ("--kernels", config.kernels, plain.kernels),
    ) if value != default]
    return flags, dropped


class VllmFleet(Fleet):
    """A ``Fleet`` whose engines are vLLM OpenAI servers (same ports, health checks, restarts)."""

    def __init__(self, config: FleetConfig, prepare_model: Callable[[str], object] | None = None,
                 python: str | None = None) -> None:
        super().__init__(config, prepare_model=None)
        self.resolve = prepare_model
        self.python = vllm_python(python)
        engine, server = config.engine()
        self.flags, self.dropped = vllm_flags(engine, server.options.api_keys)
        self.model_path = config.model
        self.served_name = engine.served_model_name or Path(config.model).name

    def start(self) -> list[str]:
        if self.config.replicas and self.resolve is not None:
            self.model_path = str(self.resolve(self.config.model))
        return super().start()

    def command(self, port: int) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                "--host", self.config.host, "--port", str(port), "--served-model-name", self.served_name,
                "--uvicorn-log-level", "warning", *self.flags]


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM's own switches: the admin reset route, CPU threads, no usage reporting."""
    return {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def check_kind(kind: str) -> str:
    if kind not in ENGINE_KINDS:
        raise ConfigError(f"unknown engine kind {kind!r}; valid: {', '.join(ENGINE_KINDS)}")
    return kind
