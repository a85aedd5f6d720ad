"""What the engine's HTTP front enforces: body limit, deadline, API keys, admin routes, workers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from chatfleet.errors import ConfigError
from chatfleet.protocol.api_keys import API_KEYS_ENV, keys_from_env, split_keys
from chatfleet.protocol.limits import DEFAULT_MAX_BODY_BYTES

API_KEY_ENV = API_KEYS_ENV  # one name for every server (the old CHATFLEET_API_KEY still read, with a warning)


@dataclass(frozen=True)
class ServerOptions:
    """Frozen, validated options of the engine's HTTP server (``chatfleet engine`` flags).

    ``api_keys``: Bearer keys every ``/v1`` route (and the admin routes) require; empty: open.
    ``enable_admin_api``: serve ``/reset_prefix_cache`` (404 otherwise).
    ``salt_cache_per_key``: with keys, each key gets its own prefix-cache salt, so one tenant
    cannot learn by timing which prompts another sent.
    ``engine_process``: run the engine core (scheduler, model, detokenizer) in a process of its
    own (``engine_process.py``), so that the HTTP work and the step loop do not share one GIL;
    off: the engine runs on a thread of the server's process (``async_engine.py``).
    """

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    request_timeout_s: float | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    enable_admin_api: bool = False
    salt_cache_per_key: bool = True
    tokenizer_workers: int = 2
    engine_process: bool = True

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max body bytes must be at least 1024, got {self.max_body_bytes}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ConfigError(f"request timeout must be > 0 seconds, got {self.request_timeout_s}")
        if any(not k or k != k.strip() for k in self.api_keys):
            raise ConfigError("API keys must be non-empty and have no surrounding spaces")
        if self.tokenizer_workers < 1:
            raise ConfigError("tokenizer workers must be >= 1")

    @staticmethod
    def keys_from(flag: str | None, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
        """Keys from ``--api-key`` (comma-separated) or else ``CHATFLEET_API_KEYS`` (``protocol.api_keys``)."""
        return split_keys(flag) if flag is not None else keys_from_env(environ)
