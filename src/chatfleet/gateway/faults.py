"""Whose fault is a replica's error reply: the replica's, or the request's?

A replica *failure* counts against its health and sends the request to another replica: the
connection refused or reset, no reply before the timeout, a failing health check, a 502/504
(whatever stands in front of it could not reach it), or a 5xx whose OpenAI error code the
replica uses for itself (``engine_dead``). A 503 without such a code means *busy*: the request
goes elsewhere, the replica stays routable. Every other reply is the replica's answer to this
request, passed on as it is: a 4xx is the client's mistake, and a 500 about one request (an
input the replica could not handle) must neither take the replica out of rotation nor be tried
on every other replica in turn. The gateway checks the health of a replica that answered 500
soon after (``ReplicaSet.check_soon``), so a replica that is really broken still goes down.
A reset on a kept-alive connection the replica had already closed (it may close one after an
error reply) is not a failure either: the proxy sends once more on a fresh connection.
"""

from __future__ import annotations

import enum
import json

REPLICA_FAULT_CODES = frozenset({"engine_dead", "no_healthy_replica"})
GATEWAY_STATUSES = frozenset({502, 504})


class Verdict(str, enum.Enum):
    ANSWER = "answer"  # the replica's reply to this request: pass it on
    BUSY = "busy"  # overloaded: retry elsewhere, keep the replica routable
    FAILURE = "failure"  # the replica failed: count it, retry elsewhere


def error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body, if it is one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError, RecursionError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def classify(status: int, body: bytes) -> Verdict:
    """The verdict on a replica's reply with HTTP ``status`` and (error) ``body``."""
    if status < 500:
        return Verdict.ANSWER
    if status in GATEWAY_STATUSES or error_code(body) in REPLICA_FAULT_CODES:
        return Verdict.FAILURE
    if status == 503:
        return Verdict.BUSY
    return Verdict.ANSWER
