"""Memory arithmetic of a MoE decoder and a sliding/full hybrid against hand-computed numbers."""

from __future__ import annotations

import pytest

from chatfleet.engine.sizing.memory import memory_breakdown
from chatfleet.plan.capacity import LengthDistribution, fit
from chatfleet.plan.vllm_pool import vllm_pool

# 4 layers, hidden 256, 4 heads x 64 (2 KV heads), 8 experts (2 active) of 192, every 2nd layer sparse
MOE = {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512,
       "moe_intermediate_size": 192, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 2,
       "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
       "max_position_embeddings": 4096, "tie_word_embeddings": False}
ATTN = 4 * (256 * 256 + 128 * 256 + 128 * 256 + 256 * 256)
DENSE_MLP = 2 * 3 * 512 * 256  # layers 0 and 2
EXPERTS = 2 * (8 * 3 * 192 * 256 + 8 * 256)  # layers 1 and 3: gate/up/down per expert + router
NORMS = 4 * (2 * 64 + 2 * 256) + 256


def test_moe_by_class_fp8_scales_per_expert_and_active_share():
    b = memory_breakdown(MOE, dtype="bfloat16")
    params = {c.tensor_class: c.num_params for c in b.classes}
    assert params == {"attention": ATTN, "mlp": DENSE_MLP, "experts": EXPERTS, "embedding": 256000,
                      "lm_head": 256000, "norms": NORMS}
    assert b.weight_bytes == 2 * (ATTN + DENSE_MLP + EXPERTS + 2 * 256000 + NORMS)
    assert b.kv_bytes_per_token == {"full": 4 * 2 * 2 * 64 * 2}
    fp8 = memory_breakdown(MOE, dtype="bfloat16", quantization="fp8")
    router = 2 * 8 * 256
    assert fp8.bytes_of("experts") == (EXPERTS - router) + 2 * router  # experts in FP8, router in 16 bits
    # block [128,128] scales: per expert gate/up 2x2 each, down 2x2; per layer q 2x2 k 1x2 v 1x2 o 2x2
    # dense layers' gate/up 4x2 each, down 2x4
    scales = 2 * 8 * (4 + 4 + 4) + 4 * (4 + 2 + 2 + 4) + 2 * (8 + 8 + 8)
    assert fp8.bytes_of("scales") == 4 * scales
    assert any("2 of 8 experts" in n for n in b.notes)


def test_sliding_full_hybrid_groups_windows_and_pools():
    cfg = {"model_type": "gemma3_text", "vocab_size": 1000, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
           "sliding_window": 512, "sliding_window_pattern": 3, "max_position_embeddings": 8192}
    b = memory_breakdown(cfg, dtype="bfloat16", kv_cache_bytes=16 * 2**20)
    full, sliding = b.kv_spec.groups
    assert (full.name, full.layer_indices, sliding.layer_indices) == ("full", (2, 5), (0, 1, 3, 4))
    assert sliding.sliding_window == 512 and full.sliding_window is None
    assert b.kv_bytes_per_token == {"full": 2 * 2 * 64 * 2, "sliding": 4 * 2 * 64 * 2}
    assert "lm_head" not in {c.tensor_class for c in b.classes}  # tied by default
    # memory split by need of one 8192-token request: full 512 blocks x 8 KiB, sliding (32+1) blocks x 16 KiB
    need_full, need_sliding = 512 * 16 * 512, 33 * 16 * 1024
    pools = {p.group.name: p.num_blocks for p in b.pool.pools}
    total = 16 * 2**20
    assert pools["full"] == int(total * need_full / (need_full + need_sliding)) // (16 * 512)
    assert pools["sliding"] == int(total * need_sliding / (need_full + need_sliding)) // (16 * 1024)
    assert b.pool_tokens == pools["full"] * 16
    # a 9000-token chat: every full block, but only its window in the sliding layers
    one = fit(b.kv_spec, b.kv_pool_bytes, LengthDistribution((9000,), "one"))
    assert one.bytes_at_mean == 563 * 16 * 512 + 33 * 16 * 1024
    # vLLM: groups of 2 layers (the full layers' count), one shared pool of 2-layer pages
    v = vllm_pool(b.kv_spec, total, 8192)
    assert (v.group_size, v.num_groups, v.padding_layers) == (2, 3, 0)
    assert v.num_blocks == total // (2 * 16 * 2 * 64 * 2)


def test_moe_cost_counts_only_active_experts():
    from chatfleet.plan.cost_model import ModelCost

    b = memory_breakdown(MOE, dtype="bfloat16")
    m = ModelCost.from_breakdown(b, MOE)
    active_experts = (EXPERTS - 2 * 8 * 256) * 2 // 8 + 2 * 8 * 256 * 2 // 8
    assert m.linear_flops_per_token == pytest.approx(2 * (ATTN + DENSE_MLP + active_experts + 256000))
    assert m.weight_bytes_per_step == b.weight_bytes - 2 * 256000  # the embedding table is gathered, not read
