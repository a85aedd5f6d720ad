"""Structured output through the HTTP app with the official openai client, on the random-weight
tiny model (which left alone never writes JSON or tool calls): ``response_format`` json_object
and json_schema, ``tool_choice`` required and named, streamed and not; the 400s of a schema the
grammar library cannot compile, a tool_choice naming no tool, and out-of-vocabulary stop ids."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.server import build_app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.runner.torch_runner import TorchRunner
from chatfleet.loopback import ServerThread

BS = 16
NUM_BLOCKS = 512
MESSAGES = [{"role": "user", "content": "Book a table and tell me the weather."}]
SCHEMA = {"type": "object", "properties": {
    "mood": {"enum": ["calm", "stormy"]}, "knots": {"type": "integer", "minimum": 0, "maximum": 60},
    "crew": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
    "required": ["mood", "knots", "crew"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}
TABLE = {"type": "object", "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12}},
         "required": ["people"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "book_table", "parameters": TABLE}}]
PARAMS = {"get_weather": WEATHER, "book_table": TABLE}


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(resolve_model("tiny"), dtype="float32")
    config = EngineConfig(model="tiny", max_model_len=2048,
                          cache=CacheConfig(block_size=BS, num_tokens=NUM_BLOCKS * BS),
                          scheduler=SchedulerConfig(max_batched_tokens=256))
    engine = AsyncEngine(Engine(config, runner=TorchRunner(loaded, NUM_BLOCKS, BS), tokenizer=loaded.tokenizer),
                         check_integrity_when_idle=True)
    with ServerThread(build_app(engine)) as srv:
        srv.tokenizer = loaded.tokenizer
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield srv
    torch.set_num_threads(threads)


def ask(server, stream=False, **kw):
    kw.setdefault("max_tokens", 400)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("seed", 7)
    c = server.client.chat.completions.create(model="tiny", messages=MESSAGES, stream=stream, **kw)
    if not stream:
        return c.choices[0].message.content, c.choices[0].message.tool_calls, c.choices[0].finish_reason
    content, calls, finish = [], {}, None
    for chunk in c:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content.append(d.content or "")
        for tc in d.tool_calls or []:
            calls[tc.index] = tc
        finish = chunk.choices[0].finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)] or None, finish


@pytest.mark.parametrize("stream", [False, True])
def test_json_object(server, stream):
    # Any JSON object: free keys and strings, which a random model would write for thousands of
    # tokens; a bias towards the closing tokens ends it soon (the grammar still decides).
    tok = server.tokenizer
    bias = {str(tok.encode(t)[0]): 8 for t in ('"', "}")}
    content, calls, finish = ask(server, stream, response_format={"type": "json_object"}, logit_bias=bias)
    assert finish == "stop" and calls is None
    assert isinstance(json.loads(content), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema(server, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "sea", "schema": SCHEMA, "strict": True}}
    content, _, finish = ask(server, stream, response_format=fmt)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required(server, stream):
    _, calls, finish = ask(server, stream, tools=TOOLS, tool_choice="required")
    assert finish == "tool_calls" and calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_named(server, stream):
    choice = {"type": "function", "function": {"name": "book_table"}}
    content, calls, finish = ask(server, stream, tools=TOOLS, tool_choice=choice)
    assert finish == "tool_calls" and [c.function.name for c in calls] == ["book_table"]
    jsonschema.validate(json.loads(calls[0].function.arguments), TABLE)
    assert not content


def test_max_tokens_inside_a_constrained_reply(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "sea", "schema": SCHEMA}}
    content, _, finish = ask(server, response_format=fmt, max_tokens=3)
    assert finish == "length"
    with pytest.raises(ValueError):
        json.loads(content)


def error_of(server, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        ask(server, **kw)
    return info.value.body


def test_an_uncompilable_schema_is_a_400_naming_the_problem(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}
    err = error_of(server, response_format=fmt)
    assert err["param"] == "response_format.json_schema.schema" and "look-around" in err["message"]
    err = error_of(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}})
    assert err["param"] == "response_format.json_schema.schema"


def test_forced_tool_errors(server):
    err = error_of(server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
    assert err["param"] == "tool_choice" and "'fly'" in err["message"]
    err = error_of(server, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert err["param"] == "response_format"


def test_out_of_vocabulary_stop_token_ids_are_refused(server):
    err = error_of(server, extra_body={"stop_token_ids": [10**6]})
    assert err["param"] == "stop_token_ids" and "vocabulary" in err["message"]


def test_completions_take_response_format(server):
    c = server.client.completions.create(model="tiny", prompt="JSON:", max_tokens=400, temperature=1.0, seed=3,
                                         extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                             "name": "sea", "schema": SCHEMA}}})
    assert c.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMA)
