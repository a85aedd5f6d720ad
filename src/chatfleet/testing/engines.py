"""Test helpers over the engine launcher (``chatfleet.engine.launcher``)."""

from __future__ import annotations

from pathlib import Path

from chatfleet.engine.launcher import Fleet, FleetConfig


def launch_engine(model: str, args: list[str] | tuple[str, ...] = (), *, threads: int = 1,
                  log_dir: Path | None = None, log_name: str = "engine",
                  startup_timeout_s: float = 180.0) -> Fleet:
    """One engine (not started yet): ``with launch_engine("tiny", ["--dtype", "float32"]) as e: e.url``.
    A built-in model name is built once before the engine starts."""
    from chatfleet.engine.builtin_models.tiny import resolve_model

    return Fleet(FleetConfig(replicas=1, model=model, threads_per_replica=threads, engine_args=tuple(args),
                             log_dir=log_dir, log_name=log_name, startup_timeout_s=startup_timeout_s),
                 prepare_model=resolve_model)
