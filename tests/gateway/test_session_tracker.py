"""Conversations in progress: keys admitted within the TTL are returning, bounded in number."""

from __future__ import annotations

import pytest

from chatfleet.errors import ConfigError
from chatfleet.gateway.session_tracker import SessionTracker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_key_is_returning_within_the_ttl_only():
    clock = Clock()
    seen = SessionTracker(ttl_s=60, max_sessions=10, clock=clock)
    assert not seen.is_returning("a")
    seen.admitted("a")
    clock.now = 59
    assert seen.is_returning("a") and not seen.is_returning("b")
    seen.admitted("a")  # each admission renews it
    clock.now = 118
    assert seen.is_returning("a")
    clock.now = 180
    assert not seen.is_returning("a") and len(seen) == 0


def test_keyless_requests_are_always_new():
    seen = SessionTracker(ttl_s=60, max_sessions=10)
    seen.admitted(None)
    assert not seen.is_returning(None) and len(seen) == 0


def test_the_least_recently_admitted_key_goes_first_when_full():
    clock = Clock()
    seen = SessionTracker(ttl_s=1000, max_sessions=3, clock=clock)
    for i, key in enumerate("abc"):
        clock.now = i
        seen.admitted(key)
    seen.admitted("a")  # now the most recent
    seen.admitted("d")
    assert len(seen) == 3 and not seen.is_returning("b")
    assert all(seen.is_returning(k) for k in "acd")


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError):
        SessionTracker(ttl_s=0, max_sessions=1)
    with pytest.raises(ConfigError):
        SessionTracker(ttl_s=1, max_sessions=0)
