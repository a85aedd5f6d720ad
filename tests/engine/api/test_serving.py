"""OpenAI request -> SamplingParams and engine outputs -> logprob shapes (pure functions)."""

import pytest
from pydantic import ValidationError

from chatfleet.engine.api.serving import (
    CompletionLogprobsBuilder,
    TokenText,
    chat_sampling_params,
    completion_prompt,
    completion_sampling_params,
)
from chatfleet.engine.api.structured_output import request_grammar
from chatfleet.engine.outputs import TokenLogprob
from chatfleet.engine.structured.spec import ANY_JSON_OBJECT
from chatfleet.errors import InvalidRequestError, RequestTooLongError
from chatfleet.protocol.openai import ChatCompletionRequest, CompletionRequest

MSG = [{"role": "user", "content": "hi"}]


class Tok:
    vocab_size = 50

    def encode(self, text):
        return [ord(c) % 50 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) * (1 + i % 2) for i in ids)


def chat(**kw):
    return ChatCompletionRequest.model_validate({"messages": MSG, **kw})


def test_chat_params_mapping():
    p = chat_sampling_params(chat(max_completion_tokens=9, max_tokens=3, temperature=0, top_k=4, seed=7,
                                  stop="x", stop_token_ids=[5], min_tokens=2, ignore_eos=True,
                                  logprobs=True, top_logprobs=3), 10, 100)
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.stop_token_ids) == (9, 0.0, 4, 7, ("x",), (5,))
    assert (p.min_tokens, p.ignore_eos, p.logprobs, p.prompt_logprobs) == (2, True, 3, None)
    assert chat_sampling_params(chat(), 10, 100).logprobs is None
    assert chat_sampling_params(chat(logprobs=True), 10, 100).logprobs == 0


def test_default_max_tokens_fills_what_is_left():
    assert chat_sampling_params(chat(), 30, 100).max_tokens == 70
    with pytest.raises(RequestTooLongError):
        chat_sampling_params(chat(), 100, 100)


def test_a_json_schema_format_without_its_schema_is_refused_as_the_document_says():
    # the OpenAPI document requires json_schema.schema with type json_schema (ResponseFormat's rule);
    # refused at validation, so a gateway refuses it too rather than forward it (schemathesis ST201)
    with pytest.raises(ValidationError, match="'schema'"):
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}})


@pytest.mark.parametrize("choice", ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}])
@pytest.mark.parametrize("tools", [None, []])
def test_a_tool_choice_without_tools_is_refused_as_the_document_says(choice, tools):
    # TOOL_CHOICE_RULE in the OpenAPI document (and OpenAI's answer): a tool_choice needs tools;
    # refused at validation so a gateway refuses it too (schemathesis ST201 found one forwarded)
    with pytest.raises(ValidationError, match="tool_choice is only allowed when tools are given"):
        chat(tool_choice=choice, tools=tools)


@pytest.mark.parametrize("kw", [
    {"response_format": {"type": "json_object"}, "tool_choice": "required",
     "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {
        "name": "f"}}]},
])
def test_grammar_options_that_cannot_be_served_are_400(kw):
    with pytest.raises(InvalidRequestError) as ei:
        request_grammar(chat(**kw), "qwen3")
    assert ei.value.param.startswith(next(iter(kw)))


def test_response_format_and_forced_tools_carry_a_grammar():
    plain = chat()
    assert request_grammar(plain, "qwen3") is None and chat_sampling_params(plain, 10, 100).grammar is None
    req = chat(response_format={"type": "json_object"})
    grammar = request_grammar(req, "qwen3")
    assert chat_sampling_params(req, 10, 100, grammar).grammar == ANY_JSON_OBJECT
    req = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required")
    spec = request_grammar(req, "qwen3").spec
    assert spec.kind == "lark" and "<tool_call>" in spec.source and '"f"' in spec.source


def test_completion_max_tokens_zero_runs_one_token_and_prompt_logprobs_only_with_echo():
    req = CompletionRequest.model_validate({"prompt": "ab", "max_tokens": 0, "echo": True, "logprobs": 2,
                                            "min_tokens": 0})
    p = completion_sampling_params(req, 2, 100)
    assert (p.max_tokens, p.logprobs, p.prompt_logprobs) == (1, 2, 2)
    req = CompletionRequest.model_validate({"prompt": "ab", "logprobs": 2})
    assert completion_sampling_params(req, 2, 100).prompt_logprobs is None
    with pytest.raises(InvalidRequestError):
        completion_sampling_params(CompletionRequest.model_validate({"prompt": "ab", "best_of": 3}), 2, 100)


def test_completion_prompt_forms():
    tok = Tok()
    assert completion_prompt(tok, CompletionRequest.model_validate({"prompt": "ab"}).prompts[0]).token_ids == [47, 48]
    ids = completion_prompt(tok, CompletionRequest.model_validate({"prompt": [[1, 2]]}).prompts[0])
    assert ids.token_ids == [1, 2] and ids.text == "bbc"
    for prompt in ([1, 99], ""):  # "" is refused by the wire model itself (a 400 naming prompt)
        with pytest.raises((InvalidRequestError, ValidationError)):
            completion_prompt(tok, CompletionRequest.model_validate({"prompt": prompt}).prompts[0])


def test_completion_logprobs_offsets_and_top():
    b = CompletionLogprobsBuilder(TokenText(Tok()), k=1)
    first = b.build([0, 1], [None, TokenLogprob(1, -0.5, [(2, -0.1), (1, -0.5)])])
    second = b.build([2], [TokenLogprob(2, float("-inf"), [])])
    assert first.tokens == ["a", "bb"] and first.text_offset == [0, 1] and first.token_logprobs == [None, -0.5]
    assert first.top_logprobs == [None, {"c": -0.1, "bb": -0.5}]
    assert second.text_offset == [3] and second.token_logprobs == [-9999.0]
