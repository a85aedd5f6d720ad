"""The one fake OpenAI server: timing stamps, its toy prefix cache and injected failures, in
one app, driven through the official openai client and raw HTTP."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from chatfleet.loopback import ServerThread
from chatfleet.protocol.sse import iter_sse
from chatfleet.testing.fake_server import FakeBehavior, FakeServer


@pytest.fixture
def fake():
    server = FakeServer(FakeBehavior(block_size=4))
    with ServerThread(server) as srv:
        srv.fake = server
        yield srv


def stream(url, **body):
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=10, json={
            "model": "fake", "stream": True, "messages": [{"role": "user", "content": "one two three four five six"}],
            **body}) as r:
        return r.status_code, [e for e in iter_sse(r.iter_bytes())]


def test_stream_chunks_carry_send_stamps_and_usage_reports_the_cache(fake):
    status, events = stream(fake.url, max_tokens=3, stream_options={"include_usage": True})
    chunks = [e.json() for e in events if not e.is_done]
    assert status == 200 and events[-1].is_done
    stamped = [c for c in chunks if c["choices"]]
    assert len(stamped) == 3 and all(c["x_req"] == 1 for c in stamped)
    assert [c["x_sent_ns"] for c in stamped] == sorted(c["x_sent_ns"] for c in stamped)
    assert stamped[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _, again = stream(fake.url, max_tokens=1, stream_options={"include_usage": True})
    assert again[-2].json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4  # one 4-word block
    assert httpx.post(fake.url + "/reset_prefix_cache").status_code == 200
    _, after = stream(fake.url, max_tokens=1, stream_options={"include_usage": True})
    assert after[-2].json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert "vllm:prefix_cache_hits_total" in httpx.get(fake.url + "/metrics").text


def test_injected_failures(fake):
    client = openai.OpenAI(base_url=fake.url + "/v1", api_key="x", max_retries=0)
    assert client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content == "tok tok "
    fake.fake.behavior.status = 503
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    fake.fake.behavior.status, fake.fake.behavior.break_after = 200, 1
    with pytest.raises(httpx.HTTPError):
        stream(fake.url, max_tokens=4)
    fake.fake.behavior.break_after, fake.fake.behavior.healthy = None, False
    assert httpx.get(fake.url + "/health").status_code == 503
    assert fake.fake.stats.requests[0]["body"]["max_tokens"] == 2
    assert httpx.post(fake.url + "/v1/chat/completions", content=b"{not json").status_code == 400
    assert json.loads(httpx.get(fake.url + "/v1/models").text)["data"][0]["id"] == "fake"
