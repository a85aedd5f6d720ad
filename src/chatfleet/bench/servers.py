"""The servers a demo or capacity run compares, each as a ``SeriesSpec`` started through the
project's one engine launcher (``chatfleet.engine.launcher``).

A chatfleet series is `chatfleet engine` with flags; a vLLM series is vLLM's CPU build from its
own virtual environment (see DESIGN.md) at the same device KV budget and dtype, started with
``VLLM_SERVER_DEV_MODE=1`` and ``--enable-prompt-tokens-details`` so the sweep can reset and
verify its prefix cache.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from chatfleet.bench.techniques import EngineArgs
from chatfleet.engine.launcher import Fleet, FleetConfig
from chatfleet.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
DEFAULT_VLLM_PYTHON = REPO / "benchmarks" / ".venv-vllm" / "bin" / "python"
VLLM_SERVED_NAME = "bench"
VLLM_CPU_BLOCK = 128
# The benchmarks' vLLM series by name, with the --kv-cache-dtype each runs.
VLLM_SERIES_KV_DTYPE = {"vllm": "auto", "vllm_fp8": "fp8"}


@dataclass(frozen=True)
class SeriesSpec:
    name: str
    kind: str  # 'chatfleet' or 'vllm'
    model: str  # 'small' / a folder (chatfleet); a folder (vllm)
    args: tuple[str, ...]
    threads: int
    request_model: str  # the model name requests carry
    env: dict[str, str] = field(default_factory=dict)
    python: Path | None = None  # the interpreter that runs vLLM
    techniques: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    @property
    def server_kind(self) -> str:
        return "vllm" if self.kind == "vllm" else "chatfleet"

    @classmethod
    def chatfleet(cls, name: str, model: str, engine: EngineArgs, threads: int) -> SeriesSpec:
        return cls(name, "chatfleet", model, engine.args, threads, model, techniques=engine.applied,
                   missing=engine.missing)

    @classmethod
    def vllm(cls, name: str, model_dir: Path, kv_bytes: int, pool_tokens: int, threads: int,
             python: Path | None = None, dtype: str = "float32", kv_cache_dtype: str = "auto") -> SeriesSpec:
        """vLLM's OpenAI server over ``kv_bytes`` of KV cache; ``kv_cache_dtype`` is its
        ``--kv-cache-dtype`` (``auto``: the model's dtype; ``fp8``: its FP8 cache, twice the tokens)."""
        python = Path(python) if python else DEFAULT_VLLM_PYTHON
        if not python.exists():
            raise ConfigError(f"vLLM's CPU build is not installed at {python} "
                              "(bash benchmarks/setup_baselines.sh vllm)")
        # vLLM's CPU backend keeps one block (128 tokens) of the pool back: it refuses a context as
        # long as the whole pool, so its longest context is one block shorter than ours.
        max_model_len = max(VLLM_CPU_BLOCK, pool_tokens - VLLM_CPU_BLOCK)
        args: tuple[str, ...] = (
            "--dtype", dtype, "--served-model-name", VLLM_SERVED_NAME, "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(kv_bytes), "--enable-prompt-tokens-details",
            "--uvicorn-log-level", "warning")
        if kv_cache_dtype != "auto":
            args += ("--kv-cache-dtype", kv_cache_dtype)
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
               "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}
        return cls(name, "vllm", str(model_dir), args, threads, VLLM_SERVED_NAME, env, python)

    def describe(self) -> str:
        if self.kind == "vllm":
            return f"vLLM CPU --model {self.model} {' '.join(self.args)} (threads {self.threads})"
        extra = f"; not in this engine yet: {', '.join(self.missing)}" if self.missing else ""
        return (f"chatfleet engine --model {self.model} {' '.join(self.args)} (threads {self.threads}; "
                f"techniques: {', '.join(self.techniques) or 'none, engine defaults'}{extra})")


class _VLLMProcess(Fleet):
    """The launcher running vLLM's OpenAI server instead of `chatfleet engine`."""

    def __init__(self, config: FleetConfig, python: Path, args: tuple[str, ...]) -> None:
        super().__init__(config)
        self.python, self.args = python, args

    def command(self, port: int) -> list[str]:
        cfg = self.config
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model,
                "--host", cfg.host, "--port", str(port), *self.args]


def _built_in(model: str) -> None:
    """Build a built-in model ('tiny', 'small') once before its engine starts."""
    from chatfleet.engine.builtin_models.tiny import resolve_model

    resolve_model(model)


@contextlib.contextmanager
def start_server(series: SeriesSpec, log_dir: Path, startup_timeout_s: float = 600.0) -> Iterator[str]:
    """Start the series' server, yield its URL, stop it however the block ends."""
    cfg = FleetConfig(replicas=1, model=series.model, threads_per_replica=series.threads,
                      engine_args=series.args if series.kind == "chatfleet" else (),
                      extra_env=dict(series.env), log_dir=Path(log_dir), log_name=f"server-{series.name}",
                      startup_timeout_s=startup_timeout_s)
    fleet = (Fleet(cfg, prepare_model=_built_in) if series.kind == "chatfleet"
             else _VLLMProcess(cfg, series.python or Path(sys.executable), series.args))
    with fleet:
        yield fleet.url
