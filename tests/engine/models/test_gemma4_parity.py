"""Our Gemma 4 against transformers' Gemma 4 on the same random weights (float32, 1e-4).

Several tiny configs: dense and MoE, with and without ``attention_k_eq_v`` and KV sharing,
per-layer inputs, soft-capping, tied and untied; sequences longer than the sliding window;
both the plain causal path and the paged cache with chunked prefill and batched decodes.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from chatfleet.engine.builtin_models.tiny import build_tiny_model
from chatfleet.engine.models.attention import KVCache, build_attention_metadata
from chatfleet.engine.models.loader import load_model
from chatfleet.errors import ConfigError

VOCAB = 4096  # the tiny tokenizer's vocabulary
WINDOW = 8
S, F = "sliding_attention", "full_attention"

BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=16, sliding_window=WINDOW,
            hidden_size_per_layer_input=0, max_position_embeddings=512, rms_norm_eps=1e-6)

CONFIGS = {
    "dense": dict(num_hidden_layers=4, layer_types=[S, F, S, F], final_logit_softcapping=30.0),
    "moe_keqv_shared": dict(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], attention_k_eq_v=True,
                            num_global_key_value_heads=1, num_kv_shared_layers=2, enable_moe_block=True,
                            num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    "ple_wide_untied": dict(num_hidden_layers=5, layer_types=[S, F, S, S, F], hidden_size_per_layer_input=8,
                            vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True,
                            tie_word_embeddings=False),
    "moe_keqv": dict(num_hidden_layers=3, layer_types=[S, S, F], attention_k_eq_v=True,
                     num_global_key_value_heads=2, enable_moe_block=True, num_experts=8, top_k_experts=3,
                     moe_intermediate_size=8, final_logit_softcapping=10.0),
}


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tok") / "m", size="tiny", seed=0)


def _randomize(model, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial norms, scales and larger projections make errors visible
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("scale", "layer_scalar")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model


def hf_causal_lm(name, seed=0):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(**{**BASE, **CONFIGS[name]})
    return _randomize(Gemma4ForCausalLM(cfg).eval(), seed)


def save(model, folder, tokenizer_files):
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_files / name, folder / name)
    return folder


def _ids(n, seed=1):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def plain_logits(loaded, ids):
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, tokenizer_files, name):
    hf = hf_causal_lm(name, seed=len(name))
    folder = save(hf, tmp_path / "m", tokenizer_files)
    ids = _ids(40)  # five windows long
    with torch.inference_mode():
        # (output_hidden_states: transformers 5.24 slices KV-shared layers without per-layer inputs wrongly)
        ref = hf(ids[None], output_hidden_states=True).logits[0].float()
    for kernels in ("torch", "auto"):
        ours = plain_logits(load_model(folder, kernels=kernels), ids)
        assert (ours - ref).abs().max().item() <= 1e-4, kernels


def _paged_logits(loaded, seqs_tokens, seed, block=4):
    """Run the sequences through the paged cache: chunked prefill (random chunks under a small
    budget, several sequences per step), then batched decodes; return per-sequence logits."""
    rng = random.Random(seed)
    model, cfg = loaded.model, loaded.config
    spec = cfg.kv_cache_spec(block, "float32")
    num_blocks = 64
    caches = [None] * cfg.num_layers
    for g in spec.groups:
        for i in g.layer_indices:
            caches[i] = KVCache.allocate(num_blocks, block, g.num_kv_heads, g.head_dim, torch.float32, "cpu")
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = [{"tokens": t, "table": [free.pop() for _ in range(-(-len(t) // block))], "done": 0,
             "logits": torch.zeros(len(t), cfg.vocab_size)} for t in seqs_tokens]
    while any(s["done"] < len(s["tokens"]) for s in seqs):
        plan, budget = [], 12
        for i, s in enumerate(seqs):
            left = len(s["tokens"]) - s["done"]
            if left and budget:
                n = min(left, budget, rng.randint(1, 9))
                plan.append((i, s["done"], n))
                budget -= n
        plan = [p for p in plan if p[2] == 1] + [p for p in plan if p[2] > 1]
        decodes = [p for p in plan if p[2] == 1]
        chunks = [p for p in plan if p[2] > 1]
        metas = {
            g.name: build_attention_metadata(
                block,
                decode_context_lens=[s + 1 for _, s, _ in decodes],
                decode_block_tables=[seqs[i]["table"] for i, _, _ in decodes],
                chunk_starts=[s for _, s, _ in chunks], chunk_lens=[n for _, _, n in chunks],
                chunk_block_tables=[seqs[i]["table"] for i, _, _ in chunks],
                device="cpu", sliding_window=g.sliding_window)
            for g in spec.groups
        }
        ids, pos = [], []
        for i, s, n in plan:
            ids += seqs[i]["tokens"][s : s + n]
            pos += list(range(s, s + n))
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), metas, caches))
        row = 0
        for i, s, n in plan:
            seqs[i]["logits"][s : s + n] = logits[row : row + n]
            seqs[i]["done"] += n
            row += n
    return [s["logits"] for s in seqs]


@pytest.mark.parametrize("name", ["dense", "moe_keqv_shared", "ple_wide_untied"])
def test_paged_cache_matches_plain(tmp_path, tokenizer_files, name):
    folder = save(hf_causal_lm(name, seed=3), tmp_path / "m", tokenizer_files)
    loaded = load_model(folder, kernels="auto")
    seqs = [_ids(n, seed=n).tolist() for n in (37, 5, 23, 1, 16)]
    paged = _paged_logits(loaded, seqs, seed=len(name))
    for tokens, got in zip(seqs, paged, strict=True):
        want = plain_logits(loaded, torch.tensor(tokens))
        assert (got - want).abs().max().item() <= 1e-4


def test_unsupported_fields_fail_by_name(tmp_path, tokenizer_files):
    folder = save(hf_causal_lm("dense"), tmp_path / "m", tokenizer_files)
    base = json.loads((folder / "config.json").read_text())
    cases = [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        ({"rope_parameters": {**base["rope_parameters"], S: {"rope_type": "yarn", "rope_theta": 1.0}}},
         "rope_type 'yarn'"),
        ({"per_layer_config": {"1": {"head_dim": 16, "intermediate_size": 8},
                               "3": {"head_dim": 16, "intermediate_size": 8}}}, "intermediate_size"),
        ({"layer_types": [S, "chunked_attention", S, F]}, "chunked_attention"),
    ]
    for patch, message in cases:
        (folder / "config.json").write_text(json.dumps({**base, **patch}))
        with pytest.raises(ConfigError, match=message):
            load_model(folder)
