"""Tenants: one per API key of the gateway.

Each tenant has:

- a prefix-cache salt derived from its key (a keyed hash, never the key), forwarded to the
  replica as the request's ``cache_salt`` (the built-in engine and vLLM both take it): two
  tenants sending the same prompt share no cached blocks, so neither can read from its time to
  first token what the other sent. A ``cache_salt`` the client sent itself is kept under the
  tenant's (``<tenant salt>/<client salt>``), so it can only split the tenant's cache further.
- a scope for session ids: the session key routed and tracked is ``<tenant id>:<key>``, and the
  session header forwarded carries it too, so two tenants using the same session id neither share
  a home replica's affinity nor each other's "returning" standing.
- limits (``key_max_in_flight``, ``key_tokens_per_minute``): requests in flight, and tokens asked
  for per minute as a token bucket charged ``prompt bytes / 4 + max_tokens`` at admission (the
  gateway does not tokenize; bytes / 4 is the usual estimate). Over either: 429 with Retry-After.

Without keys on the gateway there is one open tenant: no salt, no scope, no limits.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from chatfleet.errors import RateLimitError

BYTES_PER_TOKEN = 4
DEFAULT_MAX_TOKENS = 256  # charged when a request does not say (the replica's default applies)


def _keyed(key: str, person: bytes) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16, person=person).hexdigest()


@dataclass(frozen=True)
class Tenant:
    id: str | None  # None: the open tenant (no keys on the gateway)
    cache_salt: str | None

    def scope(self, session_key: str | None) -> str | None:
        if session_key is None or self.id is None:
            return session_key
        return f"{self.id}:{session_key}"

    def salt(self, requested: str | None) -> str | None:
        if self.cache_salt is None:
            return requested
        return self.cache_salt if requested is None else f"{self.cache_salt}/{requested}"


OPEN_TENANT = Tenant(None, None)


def tenant_of_key(key: str, *, salt_per_key: bool = True) -> Tenant:
    return Tenant(_keyed(key, b"chatfleet-tenant")[:12], _keyed(key, b"chatfleet-gwsalt") if salt_per_key else None)


def with_cache_salt(body: bytes, salt: str) -> bytes:
    """``body`` (a JSON object, already validated) with ``"cache_salt": salt`` as its last
    member; JSON readers keep the last of duplicate names, so it wins over one the client sent."""
    text = body.rstrip()
    assert text.endswith(b"}"), "a validated request body is a JSON object"
    inner = text[:-1].rstrip()
    sep = b"" if inner.endswith(b"{") else b","
    return inner + sep + b'"cache_salt":' + json.dumps(salt).encode() + b"}"


def estimated_tokens(prompt_bytes: int, max_tokens: int | None) -> int:
    return math.ceil(prompt_bytes / BYTES_PER_TOKEN) + (DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)


@dataclass
class _Usage:
    in_flight: int = 0
    tokens: float = 0.0  # the bucket's level
    at: float = 0.0  # when it was last refilled


class TenantLimits:
    """Per-tenant in-flight and token-rate limits; ``admit`` returns the release to call."""

    def __init__(self, max_in_flight: int | None, tokens_per_minute: int | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_in_flight = max_in_flight
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    @property
    def enabled(self) -> bool:
        return self.max_in_flight is not None or self.tokens_per_minute is not None

    def _refilled(self, tenant: str) -> _Usage:
        now = self._clock()
        usage = self._usage.get(tenant)
        if usage is None:
            usage = self._usage[tenant] = _Usage(tokens=float(self.tokens_per_minute or 0), at=now)
        elif self.tokens_per_minute is not None:
            rate = self.tokens_per_minute / 60.0
            usage.tokens = min(float(self.tokens_per_minute), usage.tokens + (now - usage.at) * rate)
            usage.at = now
        return usage

    def admit(self, tenant: Tenant, tokens: int) -> Callable[[], None]:
        """Take one in-flight slot and ``tokens`` from the tenant's bucket, or raise a 429."""
        if tenant.id is None or not self.enabled:
            return _nothing
        usage = self._refilled(tenant.id)
        if self.max_in_flight is not None and usage.in_flight >= self.max_in_flight:
            raise RateLimitError(f"this API key already has {usage.in_flight} requests in flight "
                                 f"(its limit is {self.max_in_flight}); retry when one ends", retry_after_s=1.0)
        if self.tokens_per_minute is not None:
            charge = min(float(tokens), float(self.tokens_per_minute))  # one huge request still fits a full bucket
            if usage.tokens < charge:
                wait = (charge - usage.tokens) / (self.tokens_per_minute / 60.0)
                raise RateLimitError(f"this API key asked for more than its {self.tokens_per_minute} tokens per "
                                     f"minute (this request: about {tokens}); retry later",
                                     retry_after_s=math.ceil(wait))
            usage.tokens -= charge
        usage.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                usage.in_flight -= 1

        return release


def _nothing() -> None:
    return None
