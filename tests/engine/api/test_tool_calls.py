"""Tool calling through the real HTTP app with the official openai client on loopback.

The tiny model would not write tool calls by itself, so the engine runs a scripted runner: it
emits a fixed reply (the model's tool-call text) token by token and records every prompt it
was given. The tests check both directions of the wiring: the tools reach the prompt through
the model's chat template, and the reply's tool-call text comes back as ``tool_calls``
(whole and streamed) with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json

import openai
import pytest

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.server import build_app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.outputs import SampledToken
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.loopback import ServerThread

BS = 16
REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris for two days?"}]


class ScriptedRunner(SimRunner):
    """Samples the scripted reply's tokens in order, then the end-of-turn token."""

    def __init__(self, script: list[int], **kw) -> None:
        super().__init__(**kw)
        self.script = script
        self.prompts: list[list[int]] = []

    def _sample(self, chunk) -> SampledToken:
        if chunk.num_output_tokens == 0:
            self.prompts.append([int(t) for t in self._read_context(chunk)])
        return SampledToken(self.script[min(chunk.num_output_tokens, len(self.script) - 1)])


@pytest.fixture(scope="module")
def server():
    tok = ChatTokenizer.from_pretrained(resolve_model("tiny"))
    script = tok.encode(REPLY) + [tok.eos_token_id]
    runner = ScriptedRunner(script, num_blocks=512, block_size=BS, vocab_size=tok.vocab_size, max_model_len=4096)
    config = EngineConfig(model="sim", max_model_len=4096, cache=CacheConfig(block_size=BS, num_tokens=512 * BS))
    engine = AsyncEngine(Engine(config, runner=runner, tokenizer=tok))
    with ServerThread(build_app(engine)) as srv:
        srv.runner, srv.tok = runner, tok
        srv.client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield srv


def test_tools_reach_the_prompt_and_the_call_comes_back(server):
    r = server.client.chat.completions.create(model="sim", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                              max_tokens=200, temperature=0)
    prompt = server.tok.decode(server.runner.prompts[-1], skip_special_tokens=False)
    assert "<tools>" in prompt and json.dumps(TOOLS[0], ensure_ascii=False) in prompt
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}


def test_streamed_deltas_assemble_the_same_call(server):
    stream = server.client.chat.completions.create(model="sim", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                   temperature=0, stream=True)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == "Checking."
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 2}


def test_without_tools_the_text_is_plain_content(server):
    r = server.client.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=200, temperature=0)
    assert "<tools>" not in server.tok.decode(server.runner.prompts[-1], skip_special_tokens=False)
    assert r.choices[0].message.content == REPLY and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    none = server.client.chat.completions.create(model="sim", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                                 max_tokens=200, temperature=0)
    assert none.choices[0].message.content == REPLY and none.choices[0].finish_reason == "stop"


def test_history_with_calls_and_results_renders_and_a_forced_choice_of_no_tool_is_refused(server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    server.client.chat.completions.create(model="sim", messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    prompt = server.tok.decode(server.runner.prompts[-1], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        server.client.chat.completions.create(model="sim", messages=MESSAGES, tools=TOOLS, max_tokens=5,
                                              tool_choice={"type": "function", "function": {"name": "fly"}})
    assert server.client.models.list().data  # still healthy


def test_logprob_tokens_as_token_ids_echo_the_exact_prompt(server):
    ids = server.tok.encode("hello there")
    r = server.client.completions.create(model="sim", prompt=ids, max_tokens=2, echo=True, logprobs=0,
                                         temperature=0, extra_body={"return_tokens_as_token_ids": True})
    tokens = r.choices[0].logprobs.tokens
    assert tokens[:len(ids)] == [f"token_id:{i}" for i in ids]
    assert tokens[len(ids):] == [f"token_id:{i}" for i in server.runner.script[:2]]
