"""What several gateways in front of the same replicas must agree on, and how they do.

- The ring: a pure function of the replica set (``routing.HashRing``), so gateways that see the
  same set place every session on the same home replica. Nothing shared.
- Whether a turn is *returning*: derived from the request where it can be (a chat that carries an
  assistant message continues a conversation, ``body.carries_earlier_turns``); for the rest (a
  client that sends only the new message with a session id) the conversations in progress are
  shared through Redis when ``--state redis://...`` is given (``Conversations``): a key
  ``chatfleet:conv:<session key>`` set with the session TTL when a turn is admitted, read by any
  gateway. Without Redis, or while it does not answer, each gateway remembers what it admitted.
- Each replica's cap: every gateway enforces its share, floor(cap / ``gateways``)
  (``GatewayConfig.cap_of``); shared counts would need two Redis round trips per request, a
  wake-up channel for waiters and leak recovery when a gateway dies holding slots, and would put
  Redis on the path that must never fail. The share holds the cap by construction, Redis or not.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from chatfleet.errors import ConfigError
from chatfleet.gateway.session_tracker import SessionTracker

if TYPE_CHECKING:
    import redis.asyncio

log = logging.getLogger("chatfleet.gateway")

KEY_PREFIX = "chatfleet:conv:"
REDIS_TIMEOUT_S = 0.5  # a slow Redis costs a request this much at most, then it is skipped
REDIS_RETRY_S = 5.0  # after a failure, Redis is skipped this long


class Conversations:
    """Conversations in progress: this gateway's memory, and Redis when configured."""

    def __init__(self, local: SessionTracker, redis_url: str | None = None) -> None:
        self.local = local
        self.redis_url = redis_url
        self._redis: redis.asyncio.Redis | None = None
        self._skip_until = 0.0
        if redis_url is not None:
            try:
                import redis.asyncio
            except ImportError:
                raise ConfigError("--state redis:// needs redis-py: pip install 'chatfleet[state]'") from None
            self._redis = redis.asyncio.Redis.from_url(
                redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
                decode_responses=True)

    @property
    def shared(self) -> bool:
        return self._redis is not None

    def _usable(self) -> redis.asyncio.Redis | None:
        return self._redis if self._redis is not None and time.monotonic() >= self._skip_until else None

    def _failed(self, what: str, exc: Exception) -> None:
        self._skip_until = time.monotonic() + REDIS_RETRY_S
        log.warning("shared state %s failed (%s: %s); this gateway's own memory for %g s",
                    what, type(exc).__name__, exc, REDIS_RETRY_S)

    async def is_returning(self, key: str | None) -> bool:
        if key is None:
            return False
        if self.local.is_returning(key):
            return True
        redis = self._usable()
        if redis is None:
            return False
        try:
            return bool(await redis.exists(KEY_PREFIX + key))
        except Exception as exc:  # redis.RedisError, OSError, timeouts: never fail the request
            self._failed("read", exc)
            return False

    async def admitted(self, key: str | None) -> None:
        if key is None:
            return
        self.local.admitted(key)
        redis = self._usable()
        if redis is None:
            return
        try:
            await redis.set(KEY_PREFIX + key, "1", px=max(1, int(self.local.ttl_s * 1000)))
        except Exception as exc:
            self._failed("write", exc)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None
