"""A replica's reply: its own failure (retry elsewhere, count it), busy, or its answer."""

from __future__ import annotations

import json

import pytest

from chatfleet.gateway.faults import Verdict, classify


def error(code=None) -> bytes:
    return json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": code}}).encode()


@pytest.mark.parametrize("status, body, verdict", [
    (200, b"{}", Verdict.ANSWER),
    (400, error("invalid_value"), Verdict.ANSWER),
    (404, error("model_not_found"), Verdict.ANSWER),
    (500, error(None), Verdict.ANSWER),  # about this request: pass it on, keep the replica
    (500, b"Internal Server Error", Verdict.ANSWER),
    (500, error("engine_dead"), Verdict.FAILURE),  # the replica says it is broken
    (503, error("engine_dead"), Verdict.FAILURE),
    (503, error("queue_full"), Verdict.BUSY),
    (503, b"", Verdict.BUSY),
    (502, b"bad gateway", Verdict.FAILURE),
    (504, b"", Verdict.FAILURE),
    (500, b"[" * 5000, Verdict.ANSWER),
])
def test_classify(status, body, verdict):
    assert classify(status, body) is verdict


def test_a_reused_connection_the_replica_closed_is_not_its_failure():
    import errno

    import aiohttp

    from chatfleet.gateway.proxy import _stale_connection

    assert _stale_connection(aiohttp.ServerDisconnectedError())
    assert _stale_connection(aiohttp.ClientOSError(errno.ECONNRESET, "Connection reset by peer"))
    assert not _stale_connection(aiohttp.ClientOSError(errno.ECONNREFUSED, "Connection refused"))
    assert not _stale_connection(TimeoutError())
