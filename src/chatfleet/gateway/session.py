"""The conversation key a request is routed by (whether it is a returning turn is the
``SessionTracker``'s call: a key seen within its TTL).

Order of sources: the session header (``X-Session-ID`` by default), then the request's ``user``
field, then the stable start of a chat: its leading system/developer messages *and* its first
user message. A shared character card alone (system prompt, no user message) is never a key:
thousands of chats share it and would all land on one replica.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SYSTEM_ROLES = ("system", "developer")


class KeySource(str, enum.Enum):
    HEADER = "header"
    USER = "user"
    CONVERSATION = "conversation"
    NONE = "none"


@dataclass(frozen=True)
class SessionKey:
    key: str | None  # None: no affinity, route by load alone
    source: KeySource


def _canonical(content: Any) -> Any:
    """Message content as plain JSON values (str, or a list of parts)."""
    return content if content is not None else ""


def conversation_start(messages: list[Any]) -> list[Any] | None:
    """Leading system messages plus the first user message, or None without a user message."""
    start: list[Any] = []
    for message in messages:
        if not isinstance(message, dict):
            return None
        role = message.get("role")
        if role in SYSTEM_ROLES and not any(m[0] == "user" for m in start):
            start.append([role, _canonical(message.get("content"))])
        elif role == "user":
            start.append(["user", _canonical(message.get("content"))])
            return start
    return None


def digest(text: str) -> str:
    # surrogatepass: a lone surrogate ("\ud800", valid JSON) is client input, not a crash
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def body_session(body: Mapping[str, Any]) -> SessionKey:
    """Session key from a parsed request body alone: its ``user``, else its conversation start."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return SessionKey(user, KeySource.USER)
    messages = body.get("messages")
    if isinstance(messages, list):
        start = conversation_start(messages)
        if start is not None:
            text = json.dumps(start, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            return SessionKey("conv:" + digest(text), KeySource.CONVERSATION)
    return SessionKey(None, KeySource.NONE)


def session_of(body: Mapping[str, Any], headers: Mapping[str, str], header_name: str) -> SessionKey:
    """Session key of a chat or completion request: the session header, else ``body_session``."""
    value = headers.get(header_name)
    if value:
        return SessionKey(value, KeySource.HEADER)
    return body_session(body)
