"""Gemma 4's memory arithmetic lists exactly the tensors transformers saves, towers as skipped."""

from __future__ import annotations

import json
import logging

import pytest
from safetensors import safe_open

from chatfleet.engine.builtin_models.tiny_gemma4 import build_named
from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.sizing.config_readers import model_shape
from chatfleet.engine.sizing.memory import memory_breakdown
from chatfleet.errors import ConfigError

S, F = "sliding_attention", "full_attention"


def _checkpoint(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}


def _listed(folder):
    shape = model_shape(json.loads((folder / "config.json").read_text()))
    return {t.name: t.shape for t in shape.tensors}


@pytest.fixture(scope="module")
def mm_folder(tmp_path_factory):
    return build_named("tiny-gemma4-moe-mm", tmp_path_factory.mktemp("g4") / "m")


def test_transformers_checkpoints_listed_exactly(tmp_path):
    from transformers import (
        Gemma4Config,
        Gemma4ForCausalLM,
        Gemma4ForConditionalGeneration,
        Gemma4TextConfig,
    )

    base = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=8)
    texts = [
        dict(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], attention_k_eq_v=True,
             num_global_key_value_heads=1, num_kv_shared_layers=2, enable_moe_block=True, num_experts=4,
             top_k_experts=2, moe_intermediate_size=16, hidden_size_per_layer_input=0),
        dict(num_hidden_layers=5, layer_types=[S, F, S, S, F], hidden_size_per_layer_input=8,
             num_kv_shared_layers=2, use_double_wide_mlp=True, tie_word_embeddings=False),
    ]
    for i, text in enumerate(texts):
        folder = tmp_path / f"t{i}"
        Gemma4ForCausalLM(Gemma4TextConfig(**base, **text)).save_pretrained(folder)
        assert _listed(folder) == _checkpoint(folder)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, position_embedding_size=64, patch_size=4,
                  use_clipped_linears=True, standardize=True)
    folder = tmp_path / "mm"
    Gemma4ForConditionalGeneration(Gemma4Config(text_config={**base, **texts[0]}, vision_config=vision)
                                   ).save_pretrained(folder)
    assert _listed(folder) == _checkpoint(folder)


def test_towers_skipped_and_counted(mm_folder):
    cfg = json.loads((mm_folder / "config.json").read_text())
    ckpt = _checkpoint(mm_folder)
    tower_params = sum(_numel(s) for n, s in ckpt.items() if "vision" in n)
    served = memory_breakdown(cfg, dtype="float32", language_model_only=True)
    full = memory_breakdown(cfg, dtype="float32", language_model_only=False)
    vision = next(c for c in served.classes if c.tensor_class == "vision")
    assert vision.skipped and vision.num_params == tower_params
    assert full.weight_bytes - served.weight_bytes == 4 * tower_params


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_engine_start_up_shows_bytes_saved(mm_folder, caplog):
    caplog.set_level(logging.INFO)
    engine = Engine(EngineConfig(model=str(mm_folder), cache=CacheConfig(num_tokens=1024)))
    tower_bytes = 4 * sum(_numel(s) for n, s in _checkpoint(mm_folder).items() if "vision" in n)
    assert engine.memory is not None and engine.memory.as_dict()["skipped_bytes"]["vision"] == tower_bytes
    assert "skipped: language model only" in caplog.text and "not read" in caplog.text
    with pytest.raises(ConfigError, match="image or audio input is not supported"):
        Engine(EngineConfig(model=str(mm_folder), language_model_only=False, cache=CacheConfig(num_tokens=1024)))
