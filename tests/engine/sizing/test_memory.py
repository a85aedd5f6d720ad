"""The memory arithmetic against hand-computed configs (no weights, no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from chatfleet.engine.sizing.config_readers import CONFIG_READERS, register_config_reader
from chatfleet.engine.sizing.memory import memory_breakdown
from chatfleet.engine.sizing.tensors import ModelShape, TensorShape
from chatfleet.errors import ConfigError

# 2 layers, hidden 256, 4 heads x 64 (2 KV heads), MLP 300 (not a multiple of 128), vocab 1000.
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 300, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "max_position_embeddings": 4096, "tie_word_embeddings": False,
}
ATTN = 2 * (256 * 256 + 128 * 256 + 128 * 256 + 256 * 256)  # q, k, v, o per layer
MLP = 2 * 3 * 300 * 256
EMB = 1000 * 256
NORMS = 2 * (2 * 64 + 2 * 256) + 256  # q/k norms, two layer norms, final norm
# block [128,128] scales per layer: q 2x2, k 1x2, v 1x2, o 2x2, gate/up 3x2 each, down 2x3
BLOCK_SCALES = 2 * (4 + 2 + 2 + 4 + 6 + 6 + 6)


SIZING_MODULES = ("memory", "tensors", "config_readers", "readers", "gemma4_reader")


def test_imports_without_torch_or_the_planner():
    """The memory arithmetic sits below the engine's tensors and below the planner."""
    imports = "; ".join(f"import chatfleet.engine.sizing.{m}" for m in SIZING_MODULES)
    code = (f"import sys; {imports}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('chatfleet.plan')))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_every_listed_reader_reads_a_config():
    from chatfleet.engine.sizing.config_readers import model_shape

    assert {"qwen3", "qwen2", "llama", "mistral", "qwen3_moe", "gemma3_text", "gemma4", "gemma4_text"} <= set(
        CONFIG_READERS)
    assert model_shape({**QWEN3, "model_type": "llama"}).kv_spec == model_shape(QWEN3).kv_spec


def test_bf16_dense_by_class_and_kv_per_token():
    b = memory_breakdown(QWEN3, dtype="bfloat16")
    assert {c.tensor_class: c.num_params for c in b.classes} == {
        "attention": ATTN, "mlp": MLP, "embedding": EMB, "lm_head": EMB, "norms": NORMS}
    assert b.bytes_of("attention") == 2 * ATTN and b.bytes_of("lm_head") == 2 * EMB
    assert b.weight_bytes == 2 * (ATTN + MLP + 2 * EMB + NORMS)
    assert b.kv_bytes_per_token == {"full": 2 * 2 * 2 * 64 * 2}  # layers x K,V x heads x dim x 2 B
    assert b.pool is None and b.pool_tokens is None and b.max_position_embeddings == 4096
    assert "attention" in b.describe() and "B/token" in b.describe()


def test_tied_embedding_counted_once():
    tied = memory_breakdown({**QWEN3, "tie_word_embeddings": True}, dtype="float32")
    assert "lm_head" not in {c.tensor_class for c in tied.classes}
    assert tied.weight_bytes == 4 * (ATTN + MLP + EMB + NORMS)
    assert tied.tie_word_embeddings and any("tied" in n for n in tied.notes)


def test_fp8_block_checkpoint_partial_blocks_and_16_bit_rest():
    cfg = {**QWEN3, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}}
    b = memory_breakdown(cfg, dtype="bfloat16")
    assert b.bytes_of("attention") == ATTN and b.bytes_of("mlp") == MLP  # one byte per weight
    assert b.bytes_of("embedding") == 2 * EMB and b.bytes_of("lm_head") == 2 * EMB and b.bytes_of("norms") == 2 * NORMS
    assert b.bytes_of("scales") == 4 * BLOCK_SCALES
    assert "block-wise [128,128]" in b.weights_format
    # quantizing a 16-bit checkpoint at load gives the same layout
    assert memory_breakdown(QWEN3, dtype="bfloat16", quantization="fp8").weight_bytes == b.weight_bytes


def test_fp8_per_tensor_per_channel_and_ignored_modules():
    tensor = memory_breakdown({**QWEN3, "quantization_config": {"quant_method": "fp8"}}, dtype="bfloat16")
    assert tensor.bytes_of("scales") == 4 * 2 * 7  # one per matrix
    channel_qc = {"quant_method": "compressed-tensors", "ignore": ["lm_head"], "config_groups": {"g": {
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}
    channel = memory_breakdown({**QWEN3, "quantization_config": channel_qc}, dtype="bfloat16")
    assert channel.bytes_of("scales") == 4 * 2 * (256 + 128 + 128 + 256 + 300 + 300 + 256)  # one per output row
    ignored = memory_breakdown({**QWEN3, "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_not_convert": ["mlp.down_proj"]}},
        dtype="bfloat16")
    assert ignored.bytes_of("mlp") == 2 * (2 * 300 * 256) + 2 * 2 * 300 * 256
    assert ignored.bytes_of("scales") == 4 * (BLOCK_SCALES - 2 * 6)


def test_fp8_embedding_per_row_scales_and_fp8_kv():
    b = memory_breakdown({**QWEN3, "tie_word_embeddings": True}, dtype="bfloat16", embedding_dtype="fp8",
                         kv_cache_dtype="fp8")
    assert b.bytes_of("embedding") == EMB and b.bytes_of("scales") == 4 * 1000
    assert b.kv_bytes_per_token == {"full": 2 * 2 * 2 * 64}
    assert b.kv_dtype == "fp8"


def test_budget_minus_weights_gives_the_pool():
    bf16 = memory_breakdown(QWEN3, dtype="bfloat16")
    per_block = 1024 * 16
    budget = bf16.weight_bytes + 1000 + 10 * per_block + 7
    b = memory_breakdown(QWEN3, dtype="bfloat16", budget_bytes=budget, reserved_bytes=1000)
    assert b.pool_tokens == 160 and b.kv_pool_bytes == 10 * per_block and b.left_bytes == 7
    fp8 = memory_breakdown(QWEN3, dtype="bfloat16", kv_cache_dtype="fp8", kv_cache_bytes=10 * per_block)
    assert fp8.pool_tokens == 320  # same bytes, half the bytes per token
    assert memory_breakdown(QWEN3, kv_cache_tokens=100).pool_tokens == 96  # whole blocks
    with pytest.raises(ConfigError, match="leaves no room"):
        memory_breakdown(QWEN3, budget_bytes=bf16.weight_bytes)
    with pytest.raises(ConfigError, match="one of"):
        memory_breakdown(QWEN3, budget_bytes=budget, kv_cache_tokens=100)


def test_multimodal_towers_counted_but_skipped_for_language_model_only():
    cfg = {"model_type": "some_vlm", "text_config": QWEN3,
           "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "patch_size": 4,
                             "image_size": 16}}
    full = memory_breakdown(cfg, dtype="bfloat16")
    lm_only = memory_breakdown(cfg, dtype="bfloat16", language_model_only=True)
    text = memory_breakdown(QWEN3, dtype="bfloat16")
    assert lm_only.weight_bytes == text.weight_bytes and lm_only.skipped_bytes == full.skipped_bytes + full.bytes_of(
        "vision")
    per_layer = 4 * 64 * 64 + 2 * 64 * 128 + 9 * 64 + 128
    vision = 2 * per_layer + 64 * 3 * 16 + 16 * 64 + 256 * 64
    assert full.bytes_of("vision") == 2 * vision and full.weight_bytes == text.weight_bytes + 2 * vision
    assert "skipped" in lm_only.describe()


def test_a_registered_reader_extends_the_arithmetic():
    from chatfleet.engine.kv.spec import KVCacheSpec

    def read(cfg, block_size):
        return ModelShape("toy_moe", (TensorShape("experts.w", "experts", (4, 200, 256)),),
                          KVCacheSpec.uniform(1, 1, 8, block_size=block_size), 128)

    register_config_reader(read, "toy_moe")
    try:
        b = memory_breakdown({"model_type": "toy_moe"}, dtype="bfloat16", quantization="fp8")
        assert b.bytes_of("experts") == 4 * 200 * 256 and b.bytes_of("scales") == 4 * 4 * 2 * 2
    finally:
        del CONFIG_READERS["toy_moe"]
    with pytest.raises(ConfigError, match="no memory arithmetic"):
        memory_breakdown({"model_type": "toy_moe"})
