"""An engine process's command line, to and from an ``EngineConfig`` and its server settings.

``engine_argv(config, server)`` writes the flags of ``python -m chatfleet.engine`` (the names
``chatfleet engine`` takes), only for values that differ from the defaults;
``parse_engine_argv(argv)`` reads them back, so ``parse_engine_argv(engine_argv(c, s)) == (c, s)``.
One table, ``FLAGS``, names a flag for every field of ``EngineConfig`` (with its ``cache`` and
``scheduler``) and of ``EngineServer``; the benchmark techniques and profiles speak these flags.

Value forms: memory sizes accept units (``2GiB``) and are written in bytes (``123B``); floats
are written exactly (``repr``); a boolean is a flag pair (``--x`` / ``--no-x``) or one flag that
flips its default (``--no-prefix-cache``); API keys are one comma-separated flag; a value that
starts with ``-`` is written ``--flag=-value``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from chatfleet.engine.api.options import ServerOptions
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig, parse_memory_size
from chatfleet.errors import ConfigError

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class EngineServer:
    """What an engine process serves on besides its ``EngineConfig``: address, log level and the
    HTTP front's options (body limit, deadline, API keys, admin routes)."""

    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"  # uvicorn's
    options: ServerOptions = field(default_factory=ServerOptions)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"unknown log level {self.log_level!r}; valid: {', '.join(LOG_LEVELS)}")


# Value kinds: how a field's value is written as a flag argument and read back.
_WRITE: dict[str, Callable[[object], str]] = {
    "str": str, "int": str, "float": repr, "memory": lambda v: f"{v}B",
    "keys": lambda v: ",".join(v),  # type: ignore[arg-type]
}
_READ: dict[str, Callable[[str], object]] = {
    "str": str, "int": int, "float": float, "memory": parse_memory_size,
    "keys": lambda s: tuple(k.strip() for k in s.split(",") if k.strip()),
}


@dataclass(frozen=True)
class Flag:
    """One command-line flag and the field it sets (``path``: ``"cache.num_tokens"``).

    ``kind``: a value kind (``str``, ``int``, ``float``, ``memory``, ``keys``), ``bool`` (a pair
    ``--x`` / ``--no-x``) or ``switch`` (one flag that sets the field to ``not default``)."""

    name: str
    path: str
    kind: str
    cli: bool = True  # ``chatfleet engine`` takes it too (else only ``python -m chatfleet.engine``)

    def __post_init__(self) -> None:
        if self.kind not in (*_READ, "bool", "switch"):
            raise ConfigError(f"flag {self.name}: unknown kind {self.kind!r}")


FLAGS: tuple[Flag, ...] = (
    Flag("--model", "engine.model", "str"),
    Flag("--served-model-name", "engine.served_model_name", "str"),
    Flag("--dtype", "engine.dtype", "str"),
    Flag("--device", "engine.device", "str"),
    Flag("--kernels", "engine.kernels", "str"),
    Flag("--decode-kernel", "engine.decode_kernel", "str"),
    Flag("--seed", "engine.seed", "int"),
    Flag("--max-model-len", "engine.max_model_len", "int"),
    Flag("--threads", "engine.num_threads", "int"),
    Flag("--kv-cache-dtype", "engine.kv_cache_dtype", "str"),
    Flag("--kv-scales-from-prompts", "engine.kv_scales_from_prompts", "int"),
    Flag("--quantization", "engine.quantization", "str"),
    Flag("--embedding-dtype", "engine.embedding_dtype", "str"),
    Flag("--language-model-only", "engine.language_model_only", "bool"),
    Flag("--gpu-memory-utilization", "engine.gpu_memory_utilization", "float"),
    Flag("--enforce-eager", "engine.enforce_eager", "switch"),
    Flag("--block-size", "cache.block_size", "int"),
    Flag("--kv-cache-tokens", "cache.num_tokens", "int"),
    Flag("--kv-cache-memory", "cache.memory_bytes", "memory"),
    Flag("--no-prefix-cache", "cache.enable_prefix_caching", "switch"),
    Flag("--eviction-policy", "cache.eviction_policy", "str"),
    Flag("--host-cache-memory", "cache.host_memory_bytes", "memory"),
    Flag("--host-eviction-policy", "cache.host_eviction_policy", "str"),
    Flag("--sliding-memory-fraction", "cache.sliding_memory_fraction", "float"),
    Flag("--keep-slid-out-blocks", "cache.keep_slid_out_blocks", "bool"),
    Flag("--max-batched-tokens", "scheduler.max_batched_tokens", "int"),
    Flag("--mixed-step-tokens", "scheduler.mixed_step_tokens", "int"),
    Flag("--max-running", "scheduler.max_running", "int"),
    Flag("--max-waiting", "scheduler.max_waiting", "int"),
    Flag("--no-chunked-prefill", "scheduler.enable_chunked_prefill", "switch"),
    Flag("--scheduling-policy", "scheduler.policy", "str"),
    Flag("--max-queue-delay", "scheduler.max_queue_delay", "float"),
    Flag("--lpm-host-weight", "scheduler.lpm_host_weight", "float"),
    Flag("--host", "server.host", "str"),
    Flag("--port", "server.port", "int"),
    Flag("--log-level", "server.log_level", "str"),
    Flag("--max-body-bytes", "options.max_body_bytes", "int"),
    Flag("--request-timeout", "options.request_timeout_s", "float"),
    Flag("--api-key", "options.api_keys", "keys"),
    Flag("--enable-admin-api", "options.enable_admin_api", "switch"),
    Flag("--no-salt-cache-per-key", "options.salt_cache_per_key", "switch", cli=False),
    Flag("--tokenizer-workers", "options.tokenizer_workers", "int", cli=False),
    Flag("--engine-process", "options.engine_process", "bool"),
)

# The dataclass behind each path's first part, and its defaults.
SECTIONS: dict[str, type] = {"engine": EngineConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                             "server": EngineServer, "options": ServerOptions}
_NESTED = {"engine.cache", "engine.scheduler", "server.options"}  # sections, not flags
_DEFAULTS: dict[str, object] = {"engine": EngineConfig(), "cache": CacheConfig(), "scheduler": SchedulerConfig(),
                                "server": EngineServer(), "options": ServerOptions()}
_BY_PATH = {f.path: f for f in FLAGS}


def field_paths() -> tuple[str, ...]:
    """Every settable field, as ``section.name`` (from the dataclasses themselves)."""
    return tuple(f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
                 if f"{section}.{f.name}" not in _NESTED)


def flag_for(path: str) -> Flag:
    """The flag that sets field ``path`` (a ConfigError for a field no flag sets)."""
    try:
        return _BY_PATH[path]
    except KeyError:
        raise ConfigError(f"no engine flag sets {path!r}") from None


def flags_for(path: str, value: object) -> tuple[str, ...]:
    """The flags that set field ``path`` to ``value`` (empty for its default)."""
    flag = flag_for(path)
    section, name = path.split(".")
    default = getattr(_DEFAULTS[section], name)
    if value == default:
        return ()
    if flag.kind == "switch":
        return (flag.name,)
    if flag.kind == "bool":
        return (flag.name,) if value else ("--no-" + flag.name[2:],)
    if value is None:
        raise ConfigError(f"{flag.name} cannot be unset (its default is {default!r})")
    text = _WRITE[flag.kind](value)
    return (f"{flag.name}={text}",) if text.startswith("-") else (flag.name, text)  # "-x" is no flag


def _sections(config: EngineConfig, server: EngineServer) -> dict[str, object]:
    return {"engine": config, "cache": config.cache, "scheduler": config.scheduler, "server": server,
            "options": server.options}


def engine_argv(config: EngineConfig, server: EngineServer = EngineServer()) -> list[str]:
    """The flags that give ``config`` and ``server`` (defaults left out), in ``FLAGS`` order."""
    values = _sections(config, server)
    out: list[str] = []
    for flag in FLAGS:
        section, name = flag.path.split(".")
        out += flags_for(flag.path, getattr(values[section], name))
    return out


def _by_name() -> dict[str, tuple[Flag, object]]:
    """Each flag name the parser takes, with the field value it sets (None: the value follows)."""
    out: dict[str, tuple[Flag, object]] = {}
    for flag in FLAGS:
        section, name = flag.path.split(".")
        if flag.kind == "switch":
            out[flag.name] = (flag, not getattr(_DEFAULTS[section], name))
        elif flag.kind == "bool":
            out[flag.name] = (flag, True)
            out["--no-" + flag.name[2:]] = (flag, False)
        else:
            out[flag.name] = (flag, None)
    return out


_NAMES = _by_name()


def parse_engine_argv(argv: Sequence[str]) -> tuple[EngineConfig, EngineServer]:
    """The inverse of ``engine_argv``: the config and server the flags give over the defaults
    (a flag given twice: the later wins). ``--flag value`` and ``--flag=value`` both work; a bad
    flag or value is a ``ConfigError``."""
    values: dict[str, dict[str, object]] = {section: {} for section in SECTIONS}
    args = list(argv)
    i = 0
    while i < len(args):
        name, eq, inline = args[i].partition("=")
        if name not in _NAMES:
            raise ConfigError(f"engine arguments: unknown flag {args[i]!r}")
        flag, value = _NAMES[name]
        if value is not None:  # a switch or one side of a boolean pair
            if eq:
                raise ConfigError(f"engine arguments: {name} takes no value")
        else:
            if not eq:
                i += 1
                if i == len(args):
                    raise ConfigError(f"engine arguments: {name} needs a value")
                inline = args[i]
            try:
                value = _READ[flag.kind](inline)
            except ValueError:
                raise ConfigError(f"engine arguments: {name}: not a valid {flag.kind}: {inline!r}") from None
        section, field_name = flag.path.split(".")
        values[section][field_name] = value
        i += 1
    config = EngineConfig(**values["engine"], cache=CacheConfig(**values["cache"]),  # type: ignore[arg-type]
                          scheduler=SchedulerConfig(**values["scheduler"]))  # type: ignore[arg-type]
    server = EngineServer(**values["server"], options=ServerOptions(**values["options"]))  # type: ignore[arg-type]
    return config, server


def with_flags(config: EngineConfig, server: EngineServer, argv: Sequence[str]) -> tuple[EngineConfig, EngineServer]:
    """``config`` and ``server`` with ``argv``'s flags applied on top (later flags win)."""
    return parse_engine_argv([*engine_argv(config, server), *argv])
