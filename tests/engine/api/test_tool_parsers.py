"""The Qwen3 tool-call parser on fixtures: whole text and streamed in every split."""

import json

import pytest

from chatfleet.engine.api.tool_parsers import TOOL_PARSERS, ParsedCall
from chatfleet.errors import ConfigError

ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
TWO = ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
       '<tool_call>\n{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}\n</tool_call>')


def parse(text):
    return TOOL_PARSERS.make("qwen3").parse(text)


def streamed(text, step):
    s = TOOL_PARSERS.make("qwen3").stream()
    events = []
    for i in range(0, len(text), step):
        events += s.feed(text[i:i + step])
    events += s.finish()
    return "".join(e.content for e in events), [e.call for e in events if e.call]


def test_one_call_and_no_content():
    out = parse(ONE)
    assert out.content is None
    assert out.calls == (ParsedCall("get_weather", json.dumps({"city": "Paris", "unit": "C"})),)


def test_content_before_two_calls_and_string_arguments():
    out = parse(TWO)
    assert out.content == "Let me look."  # whitespace next to a call is dropped
    assert [c.name for c in out.calls] == ["a", "b"]
    assert [json.loads(c.arguments) for c in out.calls] == [{"x": 1}, {"y": [1, 2]}]


@pytest.mark.parametrize("text", [ONE, TWO, "plain reply, no tools", "a < b and <tool_cal is not a tag",
                                  '<tool_call>{"name": "x", "arguments": {}}', "<tool_call>not json</tool_call> ok"])
@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_streaming_in_any_split_equals_the_whole_parse(text, step):
    whole = parse(text)
    content, calls = streamed(text, step)
    assert tuple(calls) == whole.calls
    assert content == (whole.content or "")


def test_invalid_json_stays_in_the_content_and_plain_text_passes():
    bad = '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'
    out = parse(bad)
    assert out.calls == () and out.content == bad
    assert parse("a < b and <tool_cal").content == "a < b and <tool_cal"


def test_unclosed_call_with_complete_json_still_counts():
    out = parse('<tool_call>\n{"name": "x", "arguments": {"k": "v"}}\n')
    assert out.calls == (ParsedCall("x", '{"k": "v"}'),)


def test_unknown_format_lists_the_known_ones():
    with pytest.raises(ConfigError, match="qwen3"):
        TOOL_PARSERS.make("gemma9")
