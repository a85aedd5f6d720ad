"""The KV spec's arithmetic against hand-computed numbers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chatfleet.engine.config import CacheConfig
from chatfleet.engine.kv.spec import KVCacheSpec, LayerGroupSpec, spec_from_layer_kinds
from chatfleet.errors import ConfigError


def test_spec_module_imports_without_torch():
    code = "import sys; import chatfleet.engine.kv.spec; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dense_bytes_per_token_and_pool_by_memory():
    # Qwen3-8B: 36 layers, 8 KV heads, head dim 128, bf16 -> 144 KiB per token.
    spec = KVCacheSpec.uniform(36, 8, 128, kv_dtype="bfloat16")
    assert spec.bytes_per_token == 36 * 2 * 8 * 128 * 2 == 147456
    plan = spec.plan_pools(memory_bytes=4 << 30)
    assert plan.pools[0].num_blocks == (4 << 30) // (147456 * 16)
    assert plan.max_tokens_per_request == plan.pools[0].num_tokens
    fp8 = spec.with_dtype("fp8").plan_pools(memory_bytes=4 << 30)
    assert fp8.pools[0].num_blocks == (4 << 30) // (147456 // 2 * 16)


def test_pool_by_tokens_and_cache_config():
    spec = KVCacheSpec.uniform(2, 2, 16, block_size=16)
    assert CacheConfig(num_tokens=1000).plan_pools(spec).pools[0].num_blocks == 62
    assert CacheConfig().plan_pools(spec).pools[0].num_tokens == 65536
    per_block = 2 * 2 * 2 * 16 * 4 * 16
    assert CacheConfig(memory_bytes=per_block * 7 + 5).plan_pools(spec).pools[0].num_blocks == 7
    with pytest.raises(ConfigError, match="holds no block"):
        CacheConfig(memory_bytes=per_block - 1).plan_pools(spec)


def test_sliding_group_needs_only_its_window():
    g = LayerGroupSpec("sliding", (0, 1), 4, 32, block_size=16, sliding_window=100)
    assert g.blocks_for(50) == 4
    assert g.blocks_for(10_000) == 7 + 1
    full = LayerGroupSpec("full", (2,), 4, 32, block_size=16)
    assert full.blocks_for(10_000) == 625


def test_hybrid_from_layer_kinds_with_kv_sharing_and_k_eq_v():
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    kinds = kinds * 2
    spec = spec_from_layer_kinds(
        kinds, num_kv_heads={"full": 2, "sliding": 8}, head_dim={"full": 512, "sliding": 256},
        sliding_window=1024, kv_dtype="bfloat16", kv_tensors={"full": 1},
        shared_kv_layers=(10, 11),
    )
    full, sliding = spec.group("full"), spec.group("sliding")
    assert full.layer_indices == (5,) and sliding.layer_indices == (0, 1, 2, 3, 4, 6, 7, 8, 9)
    assert full.bytes_per_token == 1 * 2 * 512 * 2
    assert sliding.bytes_per_token == 9 * 2 * 8 * 256 * 2
    # A 9K-token chat: full layers keep every block, sliding ones only the window's.
    assert spec.bytes_for_request(9000) == 563 * full.bytes_per_block + 65 * sliding.bytes_per_block
    fractions = spec.default_fractions(9000)
    assert fractions["full"] + fractions["sliding"] == pytest.approx(1.0)
    plan = spec.plan_pools(memory_bytes=1 << 30, memory_fractions={"full": 0.5, "sliding": 0.5})
    assert plan.pool_of("full").num_blocks == (1 << 29) // full.bytes_per_block
    with pytest.raises(ConfigError, match="each layer group"):
        spec.plan_pools(memory_bytes=1 << 30, memory_fractions={"full": 1.0})


def test_bad_specs_fail_clearly():
    with pytest.raises(ConfigError, match="unknown KV cache dtype"):
        LayerGroupSpec("full", (0,), 1, 8, kv_dtype="int3")
    with pytest.raises(ConfigError, match="two layer groups"):
        KVCacheSpec((LayerGroupSpec("a", (0,), 1, 8), LayerGroupSpec("b", (0,), 1, 8)))
    with pytest.raises(ConfigError, match="exactly one"):
        KVCacheSpec.uniform(1, 1, 8).plan_pools()
