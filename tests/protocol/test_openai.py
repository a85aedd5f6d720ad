import pytest
from pydantic import ValidationError

from chatfleet.errors import InvalidRequestError
from chatfleet.protocol.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PromptTokensDetails,
    TokenizeRequest,
    Usage,
)

MSG = [{"role": "user", "content": "hi"}]


def test_chat_request_defaults_and_extensions():
    r = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MSG, "max_completion_tokens": 7, "max_tokens": 3, "top_k": 5,
         "min_tokens": 2, "ignore_eos": True, "stop": "x", "cache_salt": "t1", "something_new": 1}
    )
    assert r.requested_max_tokens == 7 and r.top_k == 5 and r.stop_list == ["x"]
    assert r.model_extra == {"something_new": 1}
    assert not r.include_usage


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": MSG, "max_tokens": -1},
        {"messages": MSG, "max_tokens": 0},
        {"messages": MSG, "max_tokens": "many"},
        {"messages": MSG, "temperature": -0.5},
        {"messages": MSG, "top_p": 0},
        {"messages": MSG, "stop": ""},
        {"messages": MSG, "stop": [""]},
        {"messages": MSG, "stop": 5},
        {"messages": MSG, "stop": ["x"] * 17},
        {"messages": MSG, "stream_options": {"include_usage": True}},
        {"messages": MSG, "top_logprobs": 3},
        {"messages": MSG, "top_logprobs": 50, "logprobs": True},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": "hello"},
        {},
    ],
)
def test_chat_request_rejects(body):
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_include_usage():
    r = ChatCompletionRequest.model_validate(
        {"messages": MSG, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert r.include_usage


def test_message_text_parts():
    m = ChatMessage.model_validate({"role": "user",
                                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert m.text() == "ab"
    img = ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    with pytest.raises(InvalidRequestError):
        img.text()


@pytest.mark.parametrize(
    "prompt,expected",
    [("abc", ["abc"]), ([1, 2], [[1, 2]]), (["a"], ["a"]), ([[3, 4]], [[3, 4]])],
)
def test_completion_prompts(prompt, expected):
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("prompt", [[], [[]], [-1, 2], None, 3.5])
def test_completion_bad_prompt(prompt):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": prompt})


def test_completion_max_tokens_zero_allowed_for_echo():
    r = CompletionRequest.model_validate({"prompt": "a", "max_tokens": 0, "echo": True, "logprobs": 1})
    assert r.max_tokens == 0 and r.echo and r.logprobs == 1


def test_tokenize_request_exactly_one():
    TokenizeRequest.model_validate({"prompt": "x"})
    TokenizeRequest.model_validate({"messages": MSG})
    for body in ({}, {"prompt": "x", "messages": MSG}, {"messages": []}):
        with pytest.raises(ValidationError):
            TokenizeRequest.model_validate(body)


def test_usage_shape():
    u = Usage(prompt_tokens=3, completion_tokens=2, total_tokens=5,
              prompt_tokens_details=PromptTokensDetails(cached_tokens=2))
    assert u.model_dump()["prompt_tokens_details"] == {"cached_tokens": 2}
