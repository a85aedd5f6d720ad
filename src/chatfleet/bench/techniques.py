"""The warm-cache techniques a tuned engine adds to a stock one, as `chatfleet engine` flags.

Stock is the engine as it ships: prefix cache on, chunked prefill on, no cap beyond the default,
LRU eviction, FCFS scheduling, no host tier. Each technique sets ``EngineConfig`` fields
(``scheduler.max_running``, ``cache.host_memory_bytes``, ``scheduler.policy`` ...), written as
those fields' flags from ``engine/argv.py``'s table; one the installed engine lacks (its field,
read from the config dataclasses, or its policy name is unknown) is reported as missing rather
than silently dropped, so a demo or benchmark says exactly what its "tuned" series ran with.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatfleet.engine.argv import field_paths, flag_for
from chatfleet.errors import ConfigError

TECHNIQUES = ("cap", "host_tier", "session_eviction")
# Asked for by name, never part of TECHNIQUES' tuned default:
# - fp8_kv: an FP8 (e4m3) KV cache, twice the tokens in the same bytes, with per-layer scales
#   measured from the first prompt tokens where the checkpoint has none. It changes what the model
#   computes (within fp8_accuracy.py's bound), so a comparison using it gives the device budget in
#   bytes (--kv-cache-memory), not tokens.
# - lpm: longest cached prefix first. With a host tier nearly every returning turn is a hit (~92%
#   of its tokens at capacity.py's knee, the same under fcfs), so lpm only reorders the queue: near
#   saturation it serves most turns at once and holds the rest to its max-wait guard, so the TTFT
#   p95 sits at the guard where fcfs shares the wait (AMX Xeon, bf16, 288 chats: lpm with its 2-s
#   guard failed 9 of 10 windows at p95 2.05-2.12 s, fcfs passed both at 1.35 / 1.59 s, and 304 in
#   two of three; benchmarks/README.md, "the queue's order").
OPT_IN_TECHNIQUES = ("fp8_kv", "lpm")
# The benchmarks' chatfleet series by name: stock, every default technique, and those with an FP8
# cache; any other series name is that one technique alone.
SERIES_TECHNIQUES: dict[str, tuple[str, ...]] = {"stock": (), "all": TECHNIQUES, "all_fp8": (*TECHNIQUES, "fp8_kv")}


def series_techniques(name: str) -> tuple[str, ...]:
    """The techniques of the chatfleet series ``name`` (``capacity.py``, ``aiperf_capacity.py``)."""
    return SERIES_TECHNIQUES.get(name, (name,))


@dataclass(frozen=True)
class TechniqueSettings:
    max_running: int = 4  # the cap: requests in the batch
    # The cap on a step's tokens while replies decode (--mixed-step-tokens): 128, the rows the CPU's
    # decode stack takes in one call (packed_gemv.MAX_ROWS), so a returning turn's prompt chunk
    # joins the decode rows there instead of sending the step through the modules.
    mixed_step_tokens: int = 128
    host_cache_memory: str = "256MiB"  # host tier size
    max_queue_delay_s: float = 2.0  # lpm's starvation guard
    kv_scales_from_prompts: int = 512  # fp8_kv: prompt tokens its scales are measured from

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ConfigError("the cap (max running) must be >= 1")
        if self.mixed_step_tokens < 1:
            raise ConfigError("the cap on a mixed step's tokens must be >= 1")
        if self.kv_scales_from_prompts < 1:
            raise ConfigError("fp8_kv's scales need >= 1 prompt token")
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


def engine_fields() -> frozenset[str]:
    """Every ``EngineConfig`` field this engine build has, as ``section.name`` (``cache.num_tokens``),
    read from the config dataclasses themselves."""
    return frozenset(p for p in field_paths() if p.split(".")[0] in ("engine", "cache", "scheduler"))


def _policy_known(kind: str, name: str) -> bool:
    if kind == "eviction":
        from chatfleet.engine.kv.eviction_policies import EVICTION_POLICIES

        return name in EVICTION_POLICIES
    from chatfleet.engine.scheduling_policy import SCHEDULING_POLICIES

    return name in SCHEDULING_POLICIES


def _settings(name: str, s: TechniqueSettings) -> tuple[tuple[str, str], ...]:
    """A technique's ``(field path, flag value)`` pairs; the first is the one it needs."""
    if name == "cap":
        return (("scheduler.max_running", str(s.max_running)),
                ("scheduler.mixed_step_tokens", str(s.mixed_step_tokens)))
    if name == "host_tier":
        return (("cache.host_memory_bytes", s.host_cache_memory),)
    if name == "session_eviction":
        return (("cache.eviction_policy", "session"), ("cache.host_eviction_policy", "session"))
    if name == "lpm":
        return (("scheduler.policy", "lpm"), ("scheduler.max_queue_delay", f"{s.max_queue_delay_s:g}"))
    if name == "fp8_kv":
        return (("engine.kv_cache_dtype", "fp8"), ("engine.kv_scales_from_prompts", str(s.kv_scales_from_prompts)))
    raise ConfigError(f"unknown technique {name!r}; valid: {', '.join(TECHNIQUES + OPT_IN_TECHNIQUES)}")


def technique_flags(name: str, s: TechniqueSettings) -> tuple[str, ...] | None:
    """The flags of one technique, or None when this engine build lacks the field it needs (or
    the policy it names); optional fields the build lacks are left out."""
    fields = engine_fields()
    settings = _settings(name, s)
    (needed, _), *_rest = settings
    if needed not in fields:
        return None
    policy = {"session_eviction": ("eviction", "session"), "lpm": ("scheduling", "lpm")}.get(name)
    if policy is not None and not _policy_known(*policy):
        return None
    out: list[str] = []
    for path, value in settings:
        if path in fields:
            out += [flag_for(path).name, value]
    return tuple(out)


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
