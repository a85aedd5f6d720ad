"""Stream framing: chunked transfer decoding and SSE splitting, fed in arbitrary pieces."""

import json
import random

import pytest

from chatfleet.bench.transport import Endpoint, ProtocolError, _ChunkedDecoder
from chatfleet.errors import ConfigError
from chatfleet.protocol.sse import DataSplitter


def chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


@pytest.mark.parametrize("crlf", [False, True])
def test_any_split_of_the_wire_gives_the_same_events(crlf):
    sep = b"\r\n\r\n" if crlf else b"\n\n"
    events = [json.dumps({"i": i, "text": "x" * (i % 7)}).encode() for i in range(40)] + [b"[DONE]"]
    wire = chunked([b"data: " + e + sep for e in events])
    rng = random.Random(0)
    for _ in range(50):
        dec, sse, got = _ChunkedDecoder(), DataSplitter(), []
        i = 0
        while i < len(wire):
            n = rng.randint(1, 40)
            got += sse.feed(dec.feed(wire[i : i + n]))
            i += n
        assert dec.done and dec.buf == b"" and got == events


def test_bad_chunk_size_and_url():
    with pytest.raises(ProtocolError):
        _ChunkedDecoder().feed(b"zz\r\n")
    assert Endpoint.parse("http://127.0.0.1:8000/v1/").base_path == ""
    assert Endpoint.parse("https://h/api/v1").url("/v1/chat/completions") == "https://h:443/api/v1/chat/completions"
    with pytest.raises(ConfigError):
        Endpoint.parse("127.0.0.1:8000")
