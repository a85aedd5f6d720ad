"""Tool-call parsers: a model's tool-call text -> OpenAI ``tool_calls``, whole or streamed.

Each model family writes tool calls its own way; parsers are registered by format name
(``TOOL_PARSERS``) so a new family (Gemma 4's format) is one more class. ``qwen3`` (alias
``hermes``) reads what Qwen2.5/Qwen3 templates ask for::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Text outside the tags is content. A call whose JSON does not parse is left in the content as
written (tags included), so a client sees what the model said and nothing is lost silently.
The streaming parser holds back text that may be the start of a tag and emits a call once its
closing tag arrives (the whole call in one delta, as OpenAI clients accept).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from chatfleet.engine.structured.spec import GrammarSpec
from chatfleet.registry import Registry


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class StreamEvent:
    """Either content text or one complete call."""

    content: str = ""
    call: ParsedCall | None = None


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the reply was only tool calls
    calls: tuple[ParsedCall, ...]


class StreamingToolParser(Protocol):
    def feed(self, text: str) -> list[StreamEvent]: ...

    def finish(self) -> list[StreamEvent]: ...


ToolSchema = tuple[str, dict | None]  # a function's name and its parameters' JSON schema


class ToolParser(Protocol):
    def stream(self) -> StreamingToolParser: ...

    def parse(self, text: str) -> ParsedOutput: ...

    def grammar(self, tools: Sequence[ToolSchema], several: bool) -> GrammarSpec:
        """A grammar of replies that are only calls of ``tools`` in this format (one, or
        ``several``: one or more), each call's arguments following its tool's schema."""
        ...


def call_schema(tools: Sequence[ToolSchema]) -> dict:
    """The JSON schema of one call object ``{"name": ..., "arguments": {...}}`` of ``tools``
    (compact: no free whitespace, so a model cannot pad a call forever)."""
    return {"x-guidance": {"whitespace_flexible": False}, "anyOf": [
        {"type": "object", "properties": {"name": {"const": name},
                                          "arguments": params if params is not None else {"type": "object"}},
         "required": ["name", "arguments"], "additionalProperties": False}
        for name, params in tools]}


TOOL_PARSERS = Registry[ToolParser]("tool-call parser")


def _call_from_json(text: str) -> ParsedCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


class _TaggedStream:
    """State machine over ``start`` JSON ``end`` blocks; whitespace next to a call is dropped."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self.buf = ""
        self.inside = False
        self.called = False
        self.pending_space = ""  # whitespace held until non-space content follows

    def _content(self, text: str) -> list[StreamEvent]:
        if not text:
            return []
        if not text.strip():
            self.pending_space += text
            return []
        body = text.rstrip()
        out = StreamEvent(content=self.pending_space + body)
        self.pending_space = text[len(body):]  # trailing whitespace waits too
        return [out]

    def _block(self, body: str) -> list[StreamEvent]:
        call = _call_from_json(body.strip())
        if call is None:  # not a call after all: what the model wrote, as content
            return self._content(self.start + body + self.end)
        self.called = True
        self.pending_space = ""
        return [StreamEvent(call=call)]

    def feed(self, text: str) -> list[StreamEvent]:
        self.buf += text
        events: list[StreamEvent] = []
        while True:
            if self.inside:
                i = self.buf.find(self.end)
                if i < 0:
                    return events
                events += self._block(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.end):], False
                continue
            i = self.buf.find(self.start)
            if i >= 0:
                events += self._content(self.buf[:i])
                self.buf, self.inside = self.buf[i + len(self.start):], True
                continue
            keep = self._partial_tag_len(self.buf)
            events += self._content(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return events

    def _partial_tag_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of the start tag."""
        for n in range(min(len(text), len(self.start) - 1), 0, -1):
            if self.start.startswith(text[-n:]):
                return n
        return 0

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if self.inside:  # no closing tag: a complete JSON call still counts
            call = _call_from_json(self.buf.strip())
            if call is not None:
                self.called = True
                events.append(StreamEvent(call=call))
            else:
                events += self._content(self.start + self.buf)
        else:
            events += self._content(self.buf)
        self.buf, self.inside = "", False
        if self.pending_space and not self.called:
            events.append(StreamEvent(content=self.pending_space))
        self.pending_space = ""
        return events


class TaggedJSONToolParser:
    start = "<tool_call>"
    end = "</tool_call>"

    def stream(self) -> _TaggedStream:
        return _TaggedStream(self.start, self.end)

    def parse(self, text: str) -> ParsedOutput:
        s = self.stream()
        events = s.feed(text) + s.finish()
        content = "".join(e.content for e in events)
        calls = tuple(e.call for e in events if e.call is not None)
        return ParsedOutput(content if (content or not calls) else None, calls)

    def grammar(self, tools: Sequence[ToolSchema], several: bool) -> GrammarSpec:
        start = 'start: call ("\\n" call)*' if several else "start: call"
        return GrammarSpec("lark", "\n".join((
            start,
            f"call: {json.dumps(self.start + chr(10))} body {json.dumps(chr(10) + self.end)}",
            "body: %json " + json.dumps(call_schema(tools), sort_keys=True, ensure_ascii=False),
        )) + "\n")


TOOL_PARSERS.register("qwen3")(TaggedJSONToolParser)
TOOL_PARSERS.register("hermes")(TaggedJSONToolParser)
