"""Our Qwen3 against transformers' Qwen3ForCausalLM on the same random weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from chatfleet.engine.builtin_models.tiny import build_tiny_model
from chatfleet.engine.models.linear import onednn_available
from chatfleet.engine.models.loader import load_model
from chatfleet.errors import ConfigError

VOCAB = 4096  # the tiny tokenizer's vocabulary, copied into every folder

KERNELS = [
    "torch",
    pytest.param("onednn", marks=pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32),
                                                     reason="no oneDNN")),
]

# (hidden, heads, kv heads, head_dim, tied): GQA ratios 1, 2, 4; head_dim != hidden/heads.
CONFIGS = [
    (64, 4, 4, 16, True),
    (96, 4, 2, 32, False),
    (64, 8, 2, 24, True),
    (80, 4, 1, 40, False),
]


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tok") / "m", size="tiny", seed=0)


def _hf_model(hidden, heads, kv_heads, head_dim, tied, seed=0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden + 16,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, tie_word_embeddings=tied, max_position_embeddings=1024,
        rope_theta=10000.0 + seed,
    )
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms and larger projections make errors visible
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "proj" in name:
                p.normal_(0.0, 0.08)
    return model


def _save(model, folder, tokenizer_files, **kw):
    model.save_pretrained(folder, **kw)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / name, folder / name)
    return folder


def _compare(hf_model, folder, dtype="float32", n=48, kernels="auto"):
    ids = torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(1))
    loaded = load_model(folder, dtype=dtype, kernels=kernels)
    with torch.inference_mode():
        ref = hf_model(ids).logits[0].float()
        ours = loaded.model.compute_logits(loaded.model(ids[0], torch.arange(n)))
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    return (ours - ref).abs().max().item()


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("hidden,heads,kv_heads,head_dim,tied", CONFIGS)
def test_logits_match_transformers(tmp_path, tokenizer_files, hidden, heads, kv_heads, head_dim, tied, kernels):
    hf = _hf_model(hidden, heads, kv_heads, head_dim, tied)
    folder = _save(hf, tmp_path / "m", tokenizer_files)
    assert ("lm_head.weight" in json.dumps(list(hf.state_dict()))) or tied
    assert _compare(hf, folder, kernels=kernels) <= 1e-4


@pytest.mark.parametrize("kernels", KERNELS)
def test_long_sequence_matches_transformers(tmp_path, tokenizer_files, kernels):
    """Longer than one block of query rows of the oneDNN prefill attention."""
    hf = _hf_model(64, 8, 2, 24, False, seed=3)
    folder = _save(hf, tmp_path / "m", tokenizer_files)
    assert _compare(hf, folder, n=300, kernels=kernels) <= 1e-4


def test_sharded_checkpoint(tmp_path, tokenizer_files):
    hf = _hf_model(96, 4, 2, 32, False, seed=1)
    folder = _save(hf, tmp_path / "m", tokenizer_files, max_shard_size="300KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 2
    assert _compare(hf, folder) <= 1e-4


def test_bf16_checkpoint_loads_as_float32_and_bfloat16(tmp_path, tokenizer_files):
    hf = _hf_model(64, 8, 2, 24, False, seed=2)
    folder = _save(hf.to(torch.bfloat16), tmp_path / "m", tokenizer_files)
    from transformers import AutoModelForCausalLM

    # The bf16-rounded weights, computed in float32 (reloaded: .to() would also round RoPE tables).
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert _compare(hf, folder, dtype="float32") <= 1e-4
    loaded = load_model(folder, dtype="bfloat16")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    for kernels in ("torch", "auto"):  # bf16 arithmetic, same weights
        assert _compare(hf, folder, dtype="bfloat16", kernels=kernels) <= 0.1


def test_unsupported_architecture_is_clear(tmp_path, tokenizer_files):
    hf = _hf_model(64, 4, 4, 16, True)
    folder = _save(hf, tmp_path / "m", tokenizer_files)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["LlamaForCausalLM"], "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture.*Qwen3ForCausalLM"):
        load_model(folder)


def test_unknown_kernels_are_clear(tokenizer_files):
    with pytest.raises(ConfigError, match="unknown kernel backend 'fast'; valid: auto, onednn, torch"):
        load_model(tokenizer_files, kernels="fast")


def test_missing_weights_are_clear(tmp_path, tokenizer_files):
    from safetensors.torch import load_file, save_file

    hf = _hf_model(64, 4, 4, 16, True)
    folder = _save(hf, tmp_path / "m", tokenizer_files)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ConfigError, match=r"missing.*layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        load_model(folder)


def test_tiny_model_matches_transformers(tokenizer_files):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tokenizer_files, dtype=torch.float32).eval()
    assert _compare(hf, tokenizer_files, n=64) <= 1e-4
