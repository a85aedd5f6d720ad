"""Large bodies are judged in the tokenizing process (``large_bodies.py``): parsed, validated and
measured there, with the verdicts the server gives small bodies; what passes reaches the route."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.large_bodies import BodyLimits, Refused, judge_body
from chatfleet.engine.api.server import build_app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.runner.torch_runner import TorchRunner
from chatfleet.loopback import ServerThread
from chatfleet.protocol.body_spool import SharedBody
from chatfleet.protocol.safe_json import LARGE_BODY_PARSER, OFF_LOOP_BYTES

CHAT = "/v1/chat/completions"
MAX_LEN = 128
PAD = OFF_LOOP_BYTES + 1000  # characters that make a body large


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(resolve_model("tiny"), dtype="float32")
    config = EngineConfig(model="tiny", max_model_len=MAX_LEN, cache=CacheConfig(block_size=16, num_tokens=1024))
    engine = AsyncEngine(Engine(config, runner=TorchRunner(loaded, 64, 16), tokenizer=loaded.tokenizer))
    app = build_app(engine)
    with ServerThread(app) as srv:
        srv.tokenizer = loaded.tokenizer
        srv.app = app
        yield srv
    torch.set_num_threads(threads)


def post(server, body: dict | bytes, path: str = CHAT) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)


def chat(content: str, role: str = "user", **extra) -> dict:
    return {"messages": [{"role": role, "content": content}], "max_tokens": 2, **extra}


def test_a_large_body_that_fits_reaches_the_route(server):
    r = post(server, chat("hi", padding="x" * PAD))  # large by a field the prompt does not hold
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_a_large_body_goes_to_the_tokenizing_process_by_name_not_pickled(server):
    """Over a socket a large body arrives in pieces and is spooled (``body_spool.py``): the route
    hands the worker its memory file's name, and the worker's verdict is the same."""
    parser = getattr(server.app.state, LARGE_BODY_PARSER)
    seen: list[type] = []

    async def spy(path, body):
        seen.append(type(body))
        return await parser(path, body)

    setattr(server.app.state, LARGE_BODY_PARSER, spy)
    try:
        ok = post(server, chat("hi", padding="x" * PAD))
        refused = post(server, chat("harbor " * (PAD // 7)))
    finally:
        setattr(server.app.state, LARGE_BODY_PARSER, parser)
    assert seen == [SharedBody, SharedBody]
    assert ok.status_code == 200, ok.text
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages", refused.text


@pytest.mark.parametrize("body, path, param, words", [
    (chat("harbor " * (PAD // 7)), CHAT, "messages", "characters, more than the 128-token context"),
    (chat("harbor " * (PAD // 7), role="nobody"), CHAT, "messages", "messages.0.role: Input should be"),
    (json.dumps(chat("x" * PAD))[:-1].encode() + b', "temperature": NaN}', CHAT, "temperature",
     "temperature: NaN is not a JSON number"),
    ({"messages": [{"role": "user", "content": "x" * 100}] * (PAD // 120), "max_tokens": 2}, CHAT, "messages",
     "messages; at "),  # too many messages for the context, as the route says of a small chat
    ({"prompt": "harbor " * (PAD // 7), "max_tokens": 2}, "/v1/completions", "prompt", "characters, more than"),
    ({"prompt": "harbor " * (PAD // 7)}, "/tokenize", "prompt", "characters, more than"),
])
def test_large_bodies_are_refused_as_small_ones_are(server, body, path, param, words):
    r = post(server, body, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_chat_over_the_context_in_tokens_is_refused_before_its_text_is_rendered(server):
    tokenizer = server.tokenizer.backend
    text = "harbor " * 300  # ~300 tokens: within the characters' bound, over a 128-token context
    limits = BodyLimits(max_tokens=MAX_LEN, max_chars=10 * len(text))
    body = json.dumps(chat(text)).encode()
    refused = judge_body(tokenizer, CHAT, body, limits)
    assert isinstance(refused, Refused) and refused.too_long and refused.param == "messages"
    fits = json.dumps(chat("harbor " * 20)).encode()
    assert judge_body(tokenizer, CHAT, fits, limits) == json.loads(fits)
    assistant_only = json.dumps(chat(text, role="assistant")).encode()  # a template may drop its words
    assert not isinstance(judge_body(tokenizer, CHAT, assistant_only, limits), Refused)
    r = post(server, chat(text, padding="x" * PAD))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
