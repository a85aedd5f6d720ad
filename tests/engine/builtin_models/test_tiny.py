"""The built-in tiny models: deterministic, loadable by transformers, cached once."""

from __future__ import annotations

import hashlib
import json
import time

import pytest
import torch
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.engine.builtin_models.tiny import CACHE_VERSION, SIZES, build_tiny_model, resolve_model
from chatfleet.errors import ConfigError


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    start = time.perf_counter()
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", size="tiny", seed=0)
    print(f"tiny build: {time.perf_counter() - start:.2f} s")
    return path


def test_folder_layout(tiny_dir):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json"):
        assert (tiny_dir / name).is_file(), name
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["max_position_embeddings"] >= 16384
    assert cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]
    tok_cfg = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_cfg["chat_template"]


def test_same_seed_same_weights(tiny_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", size="tiny", seed=0)
    other = build_tiny_model(tmp_path / "other", size="tiny", seed=1)
    assert _sha(again / "model.safetensors") == _sha(tiny_dir / "model.safetensors")
    assert _sha(again / "tokenizer.json") == _sha(tiny_dir / "tokenizer.json")
    assert _sha(other / "model.safetensors") != _sha(tiny_dir / "model.safetensors")


def test_transformers_loads_and_generates_varied_tokens(tiny_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    assert 500_000 < n_params < 10_000_000
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    assert len(set(out)) >= 8, f"greedy output is degenerate: {out}"


def test_small_size_shape(tmp_path):
    start = time.perf_counter()
    path = build_tiny_model(tmp_path / "small", size="small", seed=0)
    print(f"small build: {time.perf_counter() - start:.2f} s")
    cfg = json.loads((path / "config.json").read_text())
    spec = SIZES["small"]
    n = cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg["tie_word_embeddings"] else 2)
    per_layer = spec.hidden_size * (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    per_layer += spec.num_heads * spec.head_dim * spec.hidden_size + 3 * spec.hidden_size * spec.intermediate_size
    n += per_layer * spec.num_layers
    assert 10_000_000 < n < 100_000_000
    assert cfg["vocab_size"] > 6000


def test_resolve_builds_once_into_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATFLEET_CACHE", str(tmp_path / "cache"))
    first = resolve_model("tiny")
    assert first == tmp_path / "cache" / "models" / f"tiny-{CACHE_VERSION}"
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert resolve_model(str(first)) == first
    assert [p.name for p in first.parent.iterdir()] == [f"tiny-{CACHE_VERSION}"]  # no temp folder left behind


def test_resolve_errors(tmp_path):
    with pytest.raises(ConfigError, match="not a local folder"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_cli_builds_and_rejects_unknown_size(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["model", "tiny", "--out", str(tmp_path / "m"), "--seed", "3"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m" / "model.safetensors").is_file()
    bad = runner.invoke(app, ["model", "tiny", "--out", str(tmp_path / "b"), "--size", "huge"])
    assert bad.exit_code == 2 and "tiny, small" in bad.output
