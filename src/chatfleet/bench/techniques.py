"""The warm-cache techniques a tuned engine adds to a stock one, as `chatfleet engine` flags.

Stock is the engine as it ships: prefix cache on, chunked prefill on, no cap beyond the default,
LRU eviction, FCFS scheduling, no host tier. Each technique is a set of flags; one the installed
engine does not accept yet (its flag or policy name is unknown) is reported as missing rather
than silently dropped, so a demo or benchmark says exactly what its "tuned" series ran with.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import lru_cache

from chatfleet.errors import ConfigError

TECHNIQUES = ("cap", "host_tier", "session_eviction", "lpm")


@dataclass(frozen=True)
class TechniqueSettings:
    max_running: int = 4  # the cap: requests in the batch
    host_cache_memory: str = "256MiB"  # host tier size
    max_queue_delay_s: float = 2.0  # lpm's starvation guard

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ConfigError("the cap (max running) must be >= 1")
        if self.max_queue_delay_s <= 0:
            raise ConfigError("max queue delay must be > 0")


@dataclass(frozen=True)
class EngineArgs:
    """Flags for one engine configuration, with the techniques it asked for and got."""

    args: tuple[str, ...]
    applied: tuple[str, ...]
    missing: tuple[str, ...]  # asked for, not accepted by this engine build

    def describe(self) -> str:
        got = ", ".join(self.applied) or "none"
        return got + (f" (not in this engine yet: {', '.join(self.missing)})" if self.missing else "")


@lru_cache(maxsize=1)
def engine_flags() -> frozenset[str]:
    """Every option name `chatfleet engine` accepts (read from the command's own signature)."""
    from chatfleet.cli.engine_cmd import engine

    names: set[str] = set()
    for param in inspect.signature(engine).parameters.values():
        names.update(d for d in getattr(param.default, "param_decls", ()) or () if d.startswith("--"))
    return frozenset(names)


def _policy_known(kind: str, name: str) -> bool:
    if kind == "eviction":
        from chatfleet.engine.kv.eviction import EVICTION_POLICIES

        return name in EVICTION_POLICIES
    from chatfleet.engine import scheduling_policy

    registry = scheduling_policy.SCHEDULING_POLICIES
    return name in registry


def technique_flags(name: str, s: TechniqueSettings) -> tuple[str, ...] | None:
    """The flags of one technique, or None when this engine build does not accept them."""
    flags = engine_flags()
    if name == "cap":
        return ("--max-running", str(s.max_running))
    if name == "host_tier":
        return ("--host-cache-memory", s.host_cache_memory) if "--host-cache-memory" in flags else None
    if name == "session_eviction":
        if "--eviction-policy" not in flags or not _policy_known("eviction", "session"):
            return None
        out = ["--eviction-policy", "session"]
        if "--host-eviction-policy" in flags:
            out += ["--host-eviction-policy", "session"]
        return tuple(out)
    if name == "lpm":
        if "--scheduling-policy" not in flags or not _policy_known("scheduling", "lpm"):
            return None
        out = ["--scheduling-policy", "lpm"]
        if "--max-queue-delay" in flags:
            out += ["--max-queue-delay", f"{s.max_queue_delay_s:g}"]
        return tuple(out)
    raise ConfigError(f"unknown technique {name!r}; valid: {', '.join(TECHNIQUES)}")


def engine_args(techniques: tuple[str, ...], settings: TechniqueSettings, base: tuple[str, ...] = ()) -> EngineArgs:
    """``base`` flags plus each technique's flags; those the engine lacks are listed as missing."""
    args, applied, missing = list(base), [], []
    for t in techniques:
        flags = technique_flags(t, settings)
        if flags is None:
            missing.append(t)
        else:
            args += flags
            applied.append(t)
    return EngineArgs(tuple(args), tuple(applied), tuple(missing))
