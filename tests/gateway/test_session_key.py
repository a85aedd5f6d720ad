"""The conversation key: header, then user, then the chat's stable start (never the card alone)."""

from __future__ import annotations

import json

from chatfleet.gateway.session import KeySource, session_of

CARD = {"role": "system", "content": "You are Captain Mira, a starship pilot."}


def chat(*turns):
    return {"model": "m", "messages": [CARD, *turns]}


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def key(body, headers=None, header="X-Session-ID"):
    return session_of(body, {k.lower(): v for k, v in (headers or {}).items()}, header.lower())


def test_header_wins_then_user_field():
    body = dict(chat(user("hi")), user="alice")
    assert key(body, {"X-Session-ID": "s1"}).key == "s1"
    assert key(body, {"X-Session-ID": "s1"}).source is KeySource.HEADER
    assert key(body).key == "alice" and key(body).source is KeySource.USER
    assert key(body, {"X-Conv": "c9"}, header="X-Conv").key == "c9"


def test_every_turn_of_a_chat_shares_the_key():
    first = key(chat(user("Hello Mira")))
    later = key(chat(user("Hello Mira"), assistant("Hi!"), user("Where are we?")))
    assert first.source is KeySource.CONVERSATION and first.key == later.key


def test_chats_on_one_card_get_different_keys():
    keys = {key(chat(user(f"hello from user {i}"))).key for i in range(50)}
    assert len(keys) == 50


def test_the_card_alone_is_never_a_key():
    assert key({"messages": [CARD]}).key is None
    assert key({"messages": [CARD]}).source is KeySource.NONE
    # An assistant greeting from the card before the first user message still keys on the user.
    greeted = key(chat(assistant("Welcome aboard."), user("hi")))
    assert greeted.key is not None and greeted.key != key(chat(user("hello"))).key


def test_content_parts_and_plain_text_are_keys_too():
    parts = key(chat({"role": "user", "content": [{"type": "text", "text": "hi"}]}))
    assert parts.key is not None and parts.key != key(chat(user("hi"))).key


def test_completions_without_header_or_user_have_no_key():
    assert key({"model": "m", "prompt": "Once upon a time"}).source is KeySource.NONE
    assert key({"model": "m", "prompt": "x", "user": "bob"}).key == "bob"


def test_a_lone_surrogate_is_hashed_not_a_crash():
    body = json.loads('{"messages": [{"role": "user", "content": "\\ud800 hi"}]}')
    first, again = key(body), key(json.loads(json.dumps(body)))
    assert first.source is KeySource.CONVERSATION and first.key == again.key
    assert first.key != key(chat(user("\ufffd hi"))).key
