"""Request bodies: hostile JSON is a 400-shaped value, never a crash; large ones are
validated in a worker process with the very same result."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from concurrent.futures import ProcessPoolExecutor

import pytest

from chatfleet.gateway.body import BodyInspector, BodyRejected, ParsedBody, inspect_body
from chatfleet.gateway.session import KeySource
from chatfleet.protocol.body_spool import BodyAssembler, SharedBody

CHAT = "/v1/chat/completions"


def chat(content="hi", **extra) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}], **extra}).encode()


@pytest.mark.parametrize("body, words, param", [
    (b'{"model": "m", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}",
     "messages: the JSON is nested more than 64 levels deep", "messages"),
    (b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
     "max_tokens: the number has 5000 digits; a number may have at most 400", "max_tokens"),
    (b'{"model": "m", "temperature": NaN, "messages": []}',
     "temperature: NaN is not a JSON number; send a finite number", "temperature"),
    (b'{"model": "m", "top_p": 1e999, "messages": []}', "top_p: the number 1e999 is too large", "top_p"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content: the text holds an invalid Unicode code point", "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "the body is not valid UTF-8", None),
    (b"[1, 2]", "must be a JSON object", None),
    (b"", "malformed JSON", None),
    (chat(stream="yes")[:-1] + b", ", "malformed JSON", None),
])
def test_hostile_bodies_are_rejected_with_a_reason(body, words, param):
    result = inspect_body(CHAT, body)
    assert isinstance(result, BodyRejected) and words in result.message, result
    assert result.param == param
    assert "Python" not in result.message and "int_max_str_digits" not in result.message


def test_a_conversation_without_a_user_is_keyed_by_its_messages():
    result = inspect_body(CHAT, chat("\u00e9t\u00e9"))
    assert isinstance(result, ParsedBody) and result.session.source is KeySource.CONVERSATION


def test_a_valid_body_gives_what_routing_needs():
    result = inspect_body(CHAT, chat(stream=True, user="alice"))
    assert result == ParsedBody(stream=True, model="m", session=result.session, prompt_bytes=result.prompt_bytes)
    assert result.session.key == "alice" and result.session.source is KeySource.USER
    assert result.prompt_bytes > 0 and not result.continues and result.cache_salt is None


def test_a_body_says_whether_it_continues_a_chat_and_what_it_asks_for():
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    later = first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]
    body = {"model": "m", "messages": later, "max_tokens": 7, "cache_salt": "mine"}
    result = inspect_body(CHAT, json.dumps(body).encode())
    assert isinstance(result, ParsedBody) and result.continues
    assert (result.max_tokens, result.cache_salt) == (7, "mine")
    assert result.prompt_bytes == len(json.dumps(later, ensure_ascii=False))
    again = inspect_body(CHAT, json.dumps({"model": "m", "messages": first}).encode())
    assert isinstance(again, ParsedBody) and not again.continues and again.session == result.session


def test_large_bodies_get_the_same_verdict_from_the_worker_process():
    big = chat("word " * 100_000)
    bad = json.dumps({"model": "m", "messages": [{"role": "nobody", "content": "x" * 400_000}]}).encode()

    async def run():
        inspector = BodyInspector(offload_bytes=64 << 10)
        try:
            return [await inspector.inspect(CHAT, body) for body in (big, bad, chat())]
        finally:
            inspector.close()

    results = asyncio.run(run())
    assert results == [inspect_body(CHAT, body) for body in (big, bad, chat())]
    assert isinstance(results[0], ParsedBody) and isinstance(results[1], BodyRejected)


def _spooled(body: bytes) -> BodyAssembler:
    parts = BodyAssembler(64 << 10)
    for start in range(0, len(body), 64 << 10):  # as a socket delivers it, in pieces
        parts.add(body[start:start + (64 << 10)])
    return parts


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd_create (Linux)")
def test_a_spooled_body_goes_to_the_worker_by_name_with_the_same_verdict(monkeypatch):
    """The worker reads a shared body from the gateway's memory file (the bytes are not pickled:
    the spy sees what was sent); where it cannot open the file it gets the bytes instead."""
    big = chat("word " * 100_000)
    bad = json.dumps({"model": "m", "messages": [{"role": "nobody", "content": "x" * 400_000}]}).encode()
    sent: list[type] = []
    real = asyncio.BaseEventLoop.run_in_executor

    def spy(loop, executor, fn, *args):
        if args:  # (the pool's start goes through here too, with none)
            sent.append(type(args[-1]))
        return real(loop, executor, fn, *args)

    monkeypatch.setattr(asyncio.BaseEventLoop, "run_in_executor", spy)

    async def run():
        inspector = BodyInspector(offload_bytes=64 << 10)
        results = []
        try:
            for body in (big, bad):
                parts = _spooled(body)
                assert parts.finish() == body and parts.spooled
                shared = parts.shared()
                results.append(await inspector.inspect(CHAT, body, shared))
                parts.close()  # closed: the worker cannot open it, and is sent the bytes
                results.append(await inspector.inspect(CHAT, body, shared))
            return results
        finally:
            inspector.close()

    results = asyncio.run(run())
    expected = [inspect_body(CHAT, body) for body in (big, bad)]
    assert results == [expected[0], expected[0], expected[1], expected[1]]
    assert SharedBody in sent and sent.count(bytes) == 2  # by name each time, the bytes after a close


def test_the_worker_starts_off_the_event_loop_and_once(monkeypatch):
    """Starting the worker blocks for a few hundred ms: it happens on a thread (the event loop
    keeps ticking meanwhile), once for concurrent first bodies, and again after a close."""
    big = chat("word " * 100_000)
    threads: list[str] = []
    pools: list[ProcessPoolExecutor] = []

    class CountedPool(ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    monkeypatch.setattr("chatfleet.gateway.body.ProcessPoolExecutor", CountedPool)

    async def run():
        inspector = BodyInspector(offload_bytes=64 << 10)
        started = inspector._started

        def spy():
            threads.append(threading.current_thread().name)
            return started()

        inspector._started = spy  # type: ignore[method-assign]
        try:
            assert not inspector.started
            ticks = 0

            async def tick():
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.001)

            ticker = asyncio.create_task(tick())
            results = await asyncio.gather(*(inspector.inspect(CHAT, big) for _ in range(3)))
            ticker.cancel()
            assert inspector.started and ticks > 1 and len(pools) == 1
            inspector.close()
            assert not inspector.started
            results.append(await inspector.inspect(CHAT, big))
            return results
        finally:
            inspector.close()

    results = asyncio.run(run())
    assert results == [inspect_body(CHAT, big)] * 4
    assert len(pools) == 2  # one more after the close
    assert threads and threading.main_thread().name not in threads
