"""The Gemma 4 tiny builders: real layout, loadable by transformers and by the engine, towers unread."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.builtin_models.tiny_gemma4 import SIZES, build_named
from chatfleet.engine.models import gemma4_weights
from chatfleet.engine.models.loader import load_model


@pytest.fixture(scope="module")
def mm_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("g4") / "m"
    result = CliRunner().invoke(app, ["model", "tiny", "--arch", "gemma4", "--moe", "--multimodal", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_layout_like_the_real_checkpoint(mm_moe):
    cfg = json.loads((mm_moe / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForConditionalGeneration"] and cfg["model_type"] == "gemma4"
    text = cfg["text_config"]
    kinds = text["layer_types"]
    assert kinds == ["sliding_attention"] * 5 + ["full_attention"]
    assert text["attention_k_eq_v"] and text["global_head_dim"] > text["head_dim"]
    assert text["num_global_key_value_heads"] < text["num_key_value_heads"]
    assert text["enable_moe_block"] and text["top_k_experts"] < text["num_experts"]
    assert text["tie_word_embeddings"] and text["final_logit_softcapping"]
    assert cfg["vision_config"]["model_type"] == "gemma4_vision"
    with safe_open(str(mm_moe / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.vision_tower.") for n in names)
    assert any(n.startswith("model.embed_vision.") for n in names)
    assert "lm_head.weight" not in names  # tied


def test_dense_and_moe_have_the_same_active_width():
    for spec in SIZES.values():
        assert spec.moe_dense_intermediate_size > 0
        assert spec.moe_dense_intermediate_size + spec.top_k_experts * spec.moe_intermediate_size == \
            spec.dense_intermediate_size


def test_transformers_and_engine_agree_towers_unread(mm_moe, monkeypatch):
    from transformers import Gemma4ForConditionalGeneration

    read: list[str] = []
    real_open = gemma4_weights.safe_open

    class Recording:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            read.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(gemma4_weights, "safe_open", Recording)
    loaded = load_model(mm_moe)
    assert read and not [n for n in read if "vision" in n]
    report = loaded.weight_report
    with safe_open(str(mm_moe / "model.safetensors"), "pt") as f:
        tower = [f.get_tensor(n) for n in f.keys() if "vision" in n]
    assert report.skipped_tensors == len(tower) > 0
    assert report.skipped_bytes == sum(t.numel() * t.element_size() for t in tower)

    hf = Gemma4ForConditionalGeneration.from_pretrained(mm_moe, dtype=torch.float32).eval()
    ids = torch.randint(0, loaded.config.vocab_size, (90,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
        ours = loaded.model.compute_logits(loaded.model(ids, torch.arange(90)))
    assert (ours - ref).abs().max().item() <= 1e-4


def test_named_models_resolve_and_load(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATFLEET_CACHE", str(tmp_path))
    path = resolve_model("tiny-gemma4")
    assert path.name.startswith("tiny-gemma4") and resolve_model("tiny-gemma4") == path
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma4ForCausalLM"] and not cfg["enable_moe_block"]
    spec = load_model(path).config.kv_cache_spec(16)
    assert [g.name for g in spec.groups] == ["full", "sliding"]
    assert spec.group("sliding").sliding_window == 64
    with pytest.raises(Exception, match="gemma4"):
        build_named("huge-gemma4", tmp_path / "x")
