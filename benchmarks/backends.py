"""The servers the benchmarks compare: ours, vLLM's CPU build, `transformers serve`.

Each `Backend` knows how to start its server on a model folder with a given number of compute
threads and KV budget, which request fields force an exact reply length, and whether it can reset
its prefix cache. The baseline venvs come from benchmarks/setup_baselines.sh.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from common import BENCH_DIR

VLLM_PY = BENCH_DIR / ".venv-vllm" / "bin" / "python"
HF_TRANSFORMERS = BENCH_DIR / ".venv-hf" / "bin" / "transformers"
SERVED_NAME = "bench"


@dataclass(frozen=True)
class LaunchSpec:
    """What one server needs: its command line, extra environment, and the model name to send."""

    argv: list[str]
    env: dict[str, str]
    request_model: str


class Launcher(Protocol):
    def __call__(self, model_dir: Path, port: int, threads: int, kv_bytes: int, max_len: int,
                 dtype: str = "float32") -> LaunchSpec: ...


@dataclass(frozen=True)
class Backend:
    name: str
    label: str
    launch: Launcher  # (dir, port, threads, kv_bytes, max_len, dtype="float32"): every server pins the dtype
    force_length: Callable[[int], dict[str, Any]]  # extra body fields forcing n output tokens
    can_reset_prefix_cache: bool
    installed: Callable[[], bool]
    install_hint: str


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    """K and V for every layer, from the model's config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def _thread_env(threads: int) -> dict[str, str]:
    t = str(threads)
    return {"OMP_NUM_THREADS": t, "MKL_NUM_THREADS": t, "OPENBLAS_NUM_THREADS": t}


def _ours(model_dir: Path, port: int, threads: int, kv_bytes: int, max_len: int,
          dtype: str = "float32") -> LaunchSpec:
    argv = [
        sys.executable, "-m", "chatfleet.cli.main", "engine",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--threads", str(threads),
        "--kv-cache-memory", str(kv_bytes), "--max-model-len", str(max_len),
        "--served-model-name", SERVED_NAME, "--log-level", "warning", "--enable-admin-api",
    ]
    return LaunchSpec(argv, _thread_env(threads), SERVED_NAME)


def _ours_torch(model_dir: Path, port: int, threads: int, kv_bytes: int, max_len: int,
                dtype: str = "float32") -> LaunchSpec:
    spec = _ours(model_dir, port, threads, kv_bytes, max_len, dtype)
    return LaunchSpec([*spec.argv, "--kernels", "torch"], spec.env, spec.request_model)


BASE_SRC_ENV = "CHATFLEET_BASE_SRC"  # another checkout's src/ for `ours_base` (e.g. a git worktree of main)


def _ours_base(model_dir: Path, port: int, threads: int, kv_bytes: int, max_len: int,
               dtype: str = "float32") -> LaunchSpec:
    """Ours as another checkout has it (same flags, same venv): a change's before/after in one run."""
    spec = _ours(model_dir, port, threads, kv_bytes, max_len, dtype)
    return LaunchSpec(spec.argv, {**spec.env, "PYTHONPATH": os.environ[BASE_SRC_ENV]}, spec.request_model)


def _vllm(model_dir: Path, port: int, threads: int, kv_bytes: int, max_len: int,
          dtype: str = "float32") -> LaunchSpec:
    argv = [
        str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--served-model-name", SERVED_NAME, "--max-model-len", str(max_len),
        # Exact bytes; VLLM_CPU_KVCACHE_SPACE is the same setting in whole GiB.
        "--kv-cache-memory-bytes", str(kv_bytes),
        "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning",
    ]
    env = {
        **_thread_env(threads),
        "VLLM_SERVER_DEV_MODE": "1",  # enables POST /reset_prefix_cache
        # Compute threads pinned to the first `threads` cores (vLLM's own default on this 2-core
        # machine is one compute core plus one reserved for its front end).
        "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return LaunchSpec(argv, env, SERVED_NAME)


def _hf(model_dir: Path, port: int, threads: int, kv_bytes: int, max_len: int,
        dtype: str = "float32") -> LaunchSpec:
    block = 16
    num_blocks = max(1, kv_bytes // (kv_bytes_per_token(model_dir, 2 if dtype in ("bfloat16", "float16") else 4)
                                     * block))
    argv = [
        str(HF_TRANSFORMERS), "serve", str(model_dir), "--continuous-batching",
        "--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
        "--cb-block-size", str(block), "--cb-num-blocks", str(num_blocks),
        # The per-step token budget ours and vLLM's CPU server use by default.
        "--cb-max-batch-tokens", "2048", "--log-level", "warning",
    ]
    return LaunchSpec(argv, {**_thread_env(threads), "HF_HUB_OFFLINE": "1"}, str(model_dir))


def _force_openai_ext(n: int) -> dict[str, Any]:
    return {"max_tokens": n, "min_tokens": n, "ignore_eos": True}


def _force_hf(n: int) -> dict[str, Any]:
    # `transformers serve` rejects min_tokens/ignore_eos; a per-request generation_config without
    # eos_token_id disables EOS, so exactly max_new_tokens come out.
    return {"max_tokens": n, "generation_config": json.dumps({"max_new_tokens": n, "do_sample": False})}


BACKENDS: dict[str, Backend] = {
    "ours": Backend("ours", "chatfleet", _ours, _force_openai_ext, True, lambda: True, ""),
    # Opt-in: ours on plain PyTorch kernels (F.linear, SDPA), to see what the oneDNN kernels add.
    "ours_torch": Backend("ours_torch", "chatfleet --kernels torch", _ours_torch, _force_openai_ext, True,
                          lambda: True, ""),
    # Opt-in: ours from the checkout named by CHATFLEET_BASE_SRC (a refactor's "before" beside its "after").
    "ours_base": Backend("ours_base", "chatfleet (base checkout)", _ours_base, _force_openai_ext, True,
                         lambda: bool(os.environ.get(BASE_SRC_ENV)), f"set {BASE_SRC_ENV}=/path/to/other/src"),
    "vllm": Backend(
        "vllm", "vLLM CPU", _vllm, _force_openai_ext, True, VLLM_PY.exists,
        "bash benchmarks/setup_baselines.sh vllm",
    ),
    "hf": Backend(
        "hf", "transformers serve", _hf, _force_hf, False, HF_TRANSFORMERS.exists,
        "bash benchmarks/setup_baselines.sh hf",
    ),
}


DEFAULT_BACKENDS = ("ours", "vllm", "hf")


def select_backends(only: str | None) -> list[Backend]:
    """'ours,vllm' -> those backends in that order; unknown names fail listing the valid ones."""
    if not only:
        return [BACKENDS[n] for n in DEFAULT_BACKENDS]
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise SystemExit(f"unknown backend(s) {unknown}; valid: {', '.join(BACKENDS)}")
    return [BACKENDS[n] for n in names]
