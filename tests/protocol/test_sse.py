import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chatfleet.protocol.openai import ChatCompletionChunk, ChatCompletionChunkChoice, DeltaMessage
from chatfleet.protocol.sse import DONE, DataSplitter, EventFramer, SSEParser, aiter_sse, encode_event, iter_sse


def test_encode_model_and_done():
    chunk = ChatCompletionChunk(
        id="c1", created=1, model="m", choices=[ChatCompletionChunkChoice(delta=DeltaMessage(content="hi"))]
    )
    raw = encode_event(chunk)
    assert raw.startswith(b"data: {") and raw.endswith(b"}\n\n")
    events = list(iter_sse([raw, DONE]))
    assert [e.is_done for e in events] == [False, True]
    assert events[0].json()["choices"][0]["delta"]["content"] == "hi"


def test_multiline_event_comments_and_crlf():
    raw = b": keep-alive\r\nevent: error\r\ndata: line1\r\ndata: line2\r\n\r\ndata:x\r\r"
    events = list(iter_sse([raw]))
    assert events[0].event == "error" and events[0].data == "line1\nline2"
    assert events[1].data == "x" and events[1].event is None


def test_final_event_without_blank_line_is_flushed():
    assert [e.data for e in iter_sse([b"data: a\n\ndata: b"])] == ["a", "b"]


def test_encode_roundtrip_newlines_and_unicode():
    ev = list(iter_sse([encode_event("a\nb", event="x"), encode_event({"t": "héllo 日本"})]))
    assert ev[0].data == "a\nb" and ev[0].event == "x"
    assert ev[1].json() == {"t": "héllo 日本"}


@settings(max_examples=60, deadline=None)
@given(
    payloads=st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=20), max_size=3), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_any_chunking_gives_same_events(payloads, cuts):
    raw = b"".join(encode_event(p) for p in payloads) + DONE
    points = sorted({min(c, len(raw)) for c in cuts})
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]
    events = list(iter_sse(pieces))
    assert [e.json() for e in events[:-1]] == payloads
    assert events[-1].is_done


def test_aiter_sse():
    async def gen():
        for b in (b"da", b"ta: 1\n", b"\ndata: [DONE]\n\n"):
            yield b

    async def collect():
        return [e async for e in aiter_sse(gen())]

    events = asyncio.run(collect())
    assert events[0].data == "1" and events[1].is_done


def test_parser_feed_returns_only_complete_events():
    p = SSEParser()
    assert p.feed(b"data: partial") == []
    assert [e.data for e in p.feed(b"\n\n")] == ["partial"]


def _random_splits(wire: bytes, seed: int) -> list[bytes]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(wire):
        n = rng.randint(1, 23)
        out.append(wire[i:i + n])
        i += n
    return out


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"])
def test_fast_data_splitter_agrees_with_the_parser(sep):
    events = [encode_event({"i": i, "text": "é" * (i % 5)}).replace(b"\n\n", sep) for i in range(30)]
    wire = b": keep-alive" + sep + b"".join(events) + b"data: line1\ndata: line2" + sep + DONE
    expected = [e.data.encode() for e in iter_sse([wire])]
    assert len(expected) == 32 and expected[-1] == b"[DONE]" and expected[-2] == b"line1\nline2"
    for seed in range(20):
        splitter = DataSplitter()
        got = [p for piece in _random_splits(wire, seed) for p in splitter.feed(piece)]
        assert got == expected


def test_event_framer_passes_only_whole_events():
    wire = b"".join(encode_event({"i": i}) for i in range(20)) + DONE
    for seed in range(20):
        framer, out = EventFramer(), []
        for piece in _random_splits(wire, seed):
            passed = framer.push(piece)
            assert passed == b"" or passed.endswith(b"\n\n")
            out.append(passed)
        assert framer.tail == b"" and b"".join(out) == wire
