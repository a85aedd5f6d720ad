"""Frozen gateway configuration, YAML profiles and per-replica caps from a sweep result.

A profile is a YAML file with up to three sections; every key is optional::

    gateway:            # GatewayConfig fields
      port: 8000
      max_in_flight: 32               # default per-replica cap
      replicas:
        - http://127.0.0.1:8001
        - {url: http://127.0.0.1:8002, max_in_flight: 16}
    serve:              # `chatfleet serve` only (see engine/launcher.py FleetConfig)
      replicas: 2
      model: tiny
    engine:             # `chatfleet serve` only: extra `chatfleet engine` flags
      kv_cache_tokens: 8192

Caps can also come from a `chatfleet sweep` result: its knee in requests in flight (a knee in
live chats is converted by Little's law); see ``knee.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from chatfleet.errors import ConfigError


def normalize_url(url: str) -> str:
    """'localhost:8001/' -> 'http://localhost:8001'; the replica's identity on the hash ring."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"replica URL {url!r} must look like http://HOST:PORT")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):  # accept OpenAI-style base URLs
        path = path[: -len("/v1")]
    return f"{parts.scheme}://{parts.netloc}{path}"


@dataclass(frozen=True)
class ReplicaSpec:
    """One upstream server: its base URL (without /v1) and an optional own in-flight cap."""

    url: str
    max_in_flight: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", normalize_url(self.url))
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight of {self.url} must be >= 1")

    @classmethod
    def parse(cls, value: Any) -> ReplicaSpec:
        if isinstance(value, ReplicaSpec):
            return value
        if isinstance(value, str):
            return cls(url=value)
        if isinstance(value, dict):
            unknown = set(value) - {"url", "max_in_flight"}
            if unknown or "url" not in value:
                raise ConfigError(f"replica entry {value!r} needs 'url' and may have 'max_in_flight'")
            return cls(url=value["url"], max_in_flight=value.get("max_in_flight"))
        raise ConfigError(f"cannot read replica entry {value!r}")


@dataclass(frozen=True)
class GatewayConfig:
    replicas: tuple[ReplicaSpec, ...] = ()
    replicas_from: str | None = None  # dns://HOST:PORT or k8s://NAMESPACE/SERVICE (discovery.py)
    host: str = "127.0.0.1"
    port: int = 8000
    # Session affinity and routing
    session_header: str = "X-Session-ID"
    routing_policy: str = "bounded_load"
    load_factor: float = 1.25  # c in ceil(c * mean load)
    virtual_nodes: int = 160
    # Admission
    max_in_flight: int | None = None  # default per-replica cap; None: no cap
    queue_size: int = 1024  # requests waiting, all replicas together
    max_queue_wait_s: float = 10.0
    retry_after_s: float = 1.0
    max_queued_new: int | None = None  # first turns that may wait; None: half of queue_size
    session_ttl_s: float = 600.0  # a key admitted this recently is a returning conversation
    max_sessions: int = 100_000  # conversation keys remembered for that
    # Failover
    max_retries: int = 2  # further replicas tried before the first byte reaches the client
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    failure_threshold: int = 2  # consecutive failures (active or passive) that mark a replica down
    # Upstream calls
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 300.0  # longest silence between two chunks
    total_timeout_s: float | None = None  # whole upstream call, stream included; None: no limit
    pool_timeout_s: float = 30.0  # waiting for a free upstream connection, connecting included
    max_connections_per_replica: int = 4096
    upstream_api_key: str | None = None
    # Several gateways in front of the same replicas (see fleet_state.py)
    state: str | None = None  # redis://HOST:PORT[/DB]: conversations in progress, shared
    gateways: int = 1  # gateways sharing each replica's cap: each enforces floor(cap / gateways)
    # Protection
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()  # keys for /reset_prefix_cache (open when no key is set at all)
    # Tenants (one per API key; see tenants.py)
    salt_per_key: bool = True  # each key's prefix cache apart (cache_salt forwarded to the replicas)
    key_max_in_flight: int | None = None  # requests one key may have in flight; None: no limit
    key_tokens_per_minute: int | None = None  # prompt + max_tokens one key may ask for a minute
    max_body_bytes: int = 8 << 20
    body_offload_bytes: int = 256 << 10  # larger bodies are validated in a worker process
    # Headers and logs
    request_id_header: str = "X-Request-ID"
    replica_header: str = "X-Chatfleet-Replica"
    log_level: str = "info"
    log_requests: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(ReplicaSpec.parse(r) for r in self.replicas))
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "admin_api_keys", tuple(self.admin_api_keys))
        if self.replicas_from is not None:
            from chatfleet.gateway.discovery import parse_source

            parse_source(self.replicas_from)
        if self.state is not None and urlsplit(self.state).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError(f"state {self.state!r} must be a redis://HOST:PORT URL")
        if self.gateways < 1:
            raise ConfigError(f"gateways must be >= 1, got {self.gateways}")
        for name in ("key_max_in_flight", "key_tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1 (or unset for no limit), got {value}")
        urls = [r.url for r in self.replicas]
        if len(set(urls)) != len(urls):
            raise ConfigError(f"replica URLs must be distinct, got {urls}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if not self.session_header.strip():
            raise ConfigError("session_header must not be empty")
        from chatfleet.gateway.routing import ROUTING_POLICIES

        if self.routing_policy not in ROUTING_POLICIES:
            raise ConfigError(f"unknown routing policy {self.routing_policy!r}; valid: {sorted(ROUTING_POLICIES)}")
        if not (self.load_factor > 1.0 and math.isfinite(self.load_factor)):
            raise ConfigError(f"load_factor must be a finite number > 1, got {self.load_factor}")
        if self.virtual_nodes < 1:
            raise ConfigError("virtual_nodes must be >= 1")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ConfigError("max_in_flight must be >= 1 (or unset for no cap)")
        if self.queue_size < 0:
            raise ConfigError("queue_size must be >= 0")
        if self.max_queued_new is not None and not 0 <= self.max_queued_new <= self.queue_size:
            raise ConfigError(f"max_queued_new must be in 0..queue_size ({self.queue_size}), "
                              f"got {self.max_queued_new}")
        if not self.session_ttl_s > 0:
            raise ConfigError("session_ttl_s must be > 0")
        if self.max_sessions < 1:
            raise ConfigError("max_sessions must be >= 1")
        if self.total_timeout_s is not None and not self.total_timeout_s > 0:
            raise ConfigError(f"total_timeout_s must be > 0 (or unset for no limit), got {self.total_timeout_s}")
        for name in ("max_queue_wait_s", "retry_after_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")
        if self.max_retries < 0:
            raise ConfigError("max_retries must be >= 0")
        if self.failure_threshold < 1:
            raise ConfigError("failure_threshold must be >= 1")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s",
                     "read_timeout_s", "pool_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.max_connections_per_replica < 1:
            raise ConfigError("max_connections_per_replica must be >= 1")
        if self.max_body_bytes < 1:
            raise ConfigError("max_body_bytes must be >= 1")
        if self.body_offload_bytes < 0:
            raise ConfigError("body_offload_bytes must be >= 0")
        if any(not k for k in self.api_keys + self.admin_api_keys):
            raise ConfigError("api keys must not be empty strings")
        if self.log_level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ConfigError(f"unknown log_level {self.log_level!r}")

    @property
    def new_queue_limit(self) -> int:
        """How many first turns may wait at once (returning turns may fill the rest)."""
        return self.queue_size // 2 if self.max_queued_new is None else self.max_queued_new

    def cap_of(self, spec: ReplicaSpec) -> int | None:
        """This gateway's share of the replica's cap: floor(cap / gateways), at least 1."""
        cap = spec.max_in_flight if spec.max_in_flight is not None else self.max_in_flight
        return None if cap is None else max(1, cap // self.gateways)

    def spec_of(self, url: str) -> ReplicaSpec:
        """The configured spec of ``url``, or a plain one for a discovered replica."""
        return next((s for s in self.replicas if s.url == url), ReplicaSpec(url))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GatewayConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown gateway setting(s) {unknown}; valid: {sorted(names)}")
        return cls(**data)

    def replace(self, **changes: Any) -> GatewayConfig:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Profile:
    """A parsed YAML profile: raw sections, validated by whoever consumes them."""

    gateway: dict[str, Any] = field(default_factory=dict)
    serve: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)


PROFILE_SECTIONS = ("gateway", "serve", "engine")


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read profile {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"profile {path} must be a mapping with sections {PROFILE_SECTIONS}")
    unknown = sorted(set(data) - set(PROFILE_SECTIONS))
    if unknown:
        raise ConfigError(f"profile {path}: unknown section(s) {unknown}; valid: {list(PROFILE_SECTIONS)}")
    sections = {}
    for name in PROFILE_SECTIONS:
        section = data.get(name) or {}
        if not isinstance(section, dict):
            raise ConfigError(f"profile {path}: section {name!r} must be a mapping")
        sections[name] = section
    return Profile(**sections)

