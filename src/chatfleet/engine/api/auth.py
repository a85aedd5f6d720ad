"""API keys on the engine server (``Authorization: Bearer <key>``, as vLLM's ``--api-key``).

``Authenticator.check(request)`` returns the ``Tenant`` a request belongs to, or raises a 401
(answered with ``WWW-Authenticate: Bearer``). With keys configured, each key gets a prefix-cache
salt of its own (a hash of the key, never the key itself): two tenants sending the same prompt
share no cached blocks, so neither can tell from the time to first token what the other sent.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from starlette.requests import Request

from chatfleet.errors import AuthenticationError


@dataclass(frozen=True)
class Tenant:
    """Who sent a request: ``cache_salt`` is None when requests share one prefix cache."""

    cache_salt: str | None = None

    def salt(self, requested: str | None) -> str | None:
        """The prefix-cache salt of a request that asked for ``requested`` (the ``cache_salt`` field)."""
        if self.cache_salt is None:
            return requested
        return self.cache_salt if requested is None else f"{self.cache_salt}/{requested}"


OPEN = Tenant()


def key_salt(key: str) -> str:
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"chatfleet-salt").hexdigest()


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Authenticator:
    """Checks Bearer keys; no keys: every request is let in as one tenant."""

    def __init__(self, keys: tuple[str, ...] = (), *, salt_per_key: bool = True) -> None:
        self._keys = tuple(k.encode() for k in keys)
        self._tenants = {k: Tenant(key_salt(k) if salt_per_key else None) for k in keys}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, request: Request) -> Tenant:
        if not self._keys:
            return OPEN
        token = bearer_token(request)
        if token is not None:
            given = token.encode("utf-8", "replace")
            for key, raw in zip(self._tenants, self._keys, strict=True):
                if hmac.compare_digest(given, raw):
                    return self._tenants[key]
        raise AuthenticationError(
            "missing or invalid API key; send 'Authorization: Bearer <key>'"
            if token is None else "invalid API key"
        )
