"""The memory math, shown: the start-up log, /metrics gauges and /v1/models of an engine
with an FP8 cache, FP8 weights and an FP8 embedding (the same numbers as plan/memory.py)."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.server import build_app
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.engine.sizing.memory import memory_breakdown
from chatfleet.loopback import ServerThread


@pytest.fixture(scope="module")
def served():
    from chatfleet.engine.engine import Engine

    config = EngineConfig(model="tiny", num_threads=1, kv_cache_dtype="fp8", quantization="fp8",
                          embedding_dtype="fp8", cache=CacheConfig(memory_bytes=1 << 20))
    engine = Engine(config)
    async_engine = AsyncEngine(engine)
    with ServerThread(build_app(async_engine)) as srv:
        yield srv, engine


def gauges(url: str, name: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def test_metrics_and_models_carry_the_breakdown(served):
    srv, engine = served
    m = engine.memory
    same = memory_breakdown(engine.runner.loaded.hf_config, dtype="float32", quantization="fp8",
                            embedding_dtype="fp8", kv_cache_dtype="fp8", kv_cache_bytes=1 << 20)
    assert m.weight_bytes == same.weight_bytes and m.pool_tokens == same.pool_tokens == engine.kv.total_tokens
    by_class = gauges(srv.url, "chatfleet:memory_bytes")
    assert by_class['chatfleet:memory_bytes{class="attention",model_name="tiny"}'] == m.bytes_of("attention")
    assert by_class['chatfleet:memory_bytes{class="scales",model_name="tiny"}'] == m.bytes_of("scales") > 0
    assert by_class['chatfleet:memory_bytes{class="kv_cache",model_name="tiny"}'] == m.kv_pool_bytes
    assert gauges(srv.url, "chatfleet:kv_bytes_per_token") == {
        'chatfleet:kv_bytes_per_token{group="full",model_name="tiny"}': 4 * 2 * 2 * 48 * 1}
    assert gauges(srv.url, "chatfleet:kv_cache_pool_tokens") == {
        'chatfleet:kv_cache_pool_tokens{model_name="tiny"}': engine.kv.total_tokens}
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    card = client.models.list().data[0].model_dump()
    assert card["max_model_len"] == engine.max_model_len and card["kv_cache_tokens"] == engine.kv.total_tokens


def test_start_up_log_shows_the_table(caplog):
    from chatfleet.engine.engine import Engine

    with caplog.at_level(logging.INFO, logger="chatfleet.engine.builder"):
        Engine(EngineConfig(model="tiny", kv_cache_dtype="bfloat16", cache=CacheConfig(num_tokens=512)))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Memory: qwen3" in text and "embedding" in text and "KV full: 1,536 B/token" in text
    assert "KV pool: 512 tokens" in text
