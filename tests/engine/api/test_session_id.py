"""The session id a gateway forwards (X-Session-ID, else the OpenAI `user` field) reaches the
KV blocks' history that eviction policies read. SimRunner engine behind the real HTTP app."""

from __future__ import annotations

import httpx
import openai
import pytest

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.server import build_app
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.runner.sim_runner import (
    BYTE_VOCAB_SIZE,
    SimRunner,
    make_byte_tokenizer,
)
from chatfleet.loopback import ServerThread

BS = 4


@pytest.fixture(scope="module")
def server():
    config = EngineConfig(
        model="sim", max_model_len=1024,
        cache=CacheConfig(block_size=BS, num_tokens=256 * BS, eviction_policy="session",
                          host_eviction_policy="session"),
        scheduler=SchedulerConfig(policy="lpm"),
    )
    runner = SimRunner(256, BS, vocab_size=BYTE_VOCAB_SIZE, max_model_len=1024, num_host_blocks=256)
    engine = AsyncEngine(Engine(config, runner=runner, tokenizer=make_byte_tokenizer()),
                         check_integrity_when_idle=True)
    with ServerThread(build_app(engine)) as srv:
        srv.engine = engine
        yield srv


def sessions_in_pool(server) -> set:
    def read(engine):
        return {b.session_id for b in engine.kv.pool.blocks if b.num_uses}

    return server.engine.call_threadsafe(read).result(timeout=30)


def test_header_and_user_field_name_the_session(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "hello there, how is the weather on the glass sea?"}]
    client.chat.completions.create(model="sim", messages=messages, max_tokens=3,
                                   extra_headers={"X-Session-ID": "conv-from-header"})
    client.chat.completions.create(model="sim", messages=messages + [{"role": "user", "content": "x"}],
                                   max_tokens=3, user="conv-from-user")
    assert {"conv-from-header", "conv-from-user"} <= sessions_in_pool(server)
    text = httpx.get(server.url + "/metrics").text
    assert "chatfleet:host_cache_num_blocks" in text
