"""The paged path (random block tables, chunked prefill, batched decodes) equals plain attention."""

from __future__ import annotations

import random

import pytest
import torch

from chatfleet.engine.builtin_models.tiny import build_tiny_model
from chatfleet.engine.models.attention import KVCache, build_attention_metadata
from chatfleet.engine.models.decode_attention import DECODE_PAD_LIMIT, group_decodes
from chatfleet.engine.models.loader import load_model

BLOCK = 8
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("paged") / "m", size="tiny", seed=0)


@pytest.fixture(scope="module", params=["torch", "auto"])
def loaded(folder, request):
    return load_model(folder, kernels=request.param)


def _plain_logits(model, tokens):
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))


def _run_step(model, caches, seqs, plan, pad_limit=DECODE_PAD_LIMIT):
    """plan: list of (seq index, start, n). Decodes (n == 1) must come first, as the runner orders them."""
    decodes = [p for p in plan if p[2] == 1]
    chunks = [p for p in plan if p[2] > 1]
    ids, pos = [], []
    for i, s, n in decodes + chunks:
        ids += seqs[i]["tokens"][s : s + n]
        pos += list(range(s, s + n))
    meta = build_attention_metadata(
        BLOCK,
        decode_context_lens=[s + 1 for _, s, _ in decodes],
        decode_block_tables=[seqs[i]["table"] for i, _, _ in decodes],
        chunk_starts=[s for _, s, _ in chunks],
        chunk_lens=[n for _, _, n in chunks],
        chunk_block_tables=[seqs[i]["table"] for i, _, _ in chunks],
        device="cpu",
        decode_pad_limit=pad_limit,
    )
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), meta, caches))
    row = 0
    for i, s, n in decodes + chunks:
        seqs[i]["logits"][s : s + n] = logits[row : row + n]
        row += n


@pytest.mark.parametrize("seed,pad_limit", [(0, DECODE_PAD_LIMIT), (1, DECODE_PAD_LIMIT), (2, 0)])
def test_paged_equals_plain(loaded, seed, pad_limit):
    rng = random.Random(seed)
    model, cfg = loaded.model, loaded.config
    caches = [KVCache.allocate(NUM_BLOCKS, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
              for _ in range(cfg.num_layers)]
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    prompt_lens = [37, 5, 70, 1, 16]
    decode_steps = 4
    seqs = []
    for n in prompt_lens:
        total = n + decode_steps
        table = [free.pop() for _ in range(-(-total // BLOCK))]
        seqs.append({"tokens": [rng.randrange(cfg.vocab_size) for _ in range(total)], "table": table,
                     "prompt": n, "done": 0, "logits": torch.zeros(total, cfg.vocab_size)})
    # Chunked prefill under a small token budget, then batched decode steps.
    while any(s["done"] < s["prompt"] for s in seqs):
        plan, budget = [], 24
        for i, s in enumerate(seqs):
            n = min(s["prompt"] - s["done"], budget, rng.randint(1, 20))
            if n > 0:
                plan.append((i, s["done"], n))
                s["done"] += n
                budget -= n
        plan.sort(key=lambda p: p[2] != 1)
        _run_step(model, caches, seqs, plan, pad_limit)
    for _ in range(decode_steps):
        plan = [(i, s["done"], 1) for i, s in enumerate(seqs)]
        rng.shuffle(plan)  # any order; pad_limit 0 then splits decodes into many groups
        for s in seqs:
            s["done"] += 1
        _run_step(model, caches, seqs, plan, pad_limit)
    for s in seqs:
        ref = _plain_logits(model, s["tokens"])
        assert (s["logits"] - ref).abs().max().item() < 1e-5


def test_decode_groups_split_where_padding_costs():
    assert group_decodes([], 16) == []
    assert group_decodes([3, 3, 4], 16) == [range(0, 3)]
    # three 2-block contexts would pad 3 * 48 blocks * 16 = 2,304 tokens next to a 50-block one
    assert group_decodes([2, 2, 2, 50], 16) == [range(0, 3), range(3, 4)]
    assert group_decodes([2, 2, 2, 50], 16, pad_limit=4096) == [range(0, 4)]
    assert group_decodes([1, 2, 3], 16, pad_limit=0) == [range(0, 1), range(1, 2), range(2, 3)]
    assert group_decodes([5, 5, 5], 16, pad_limit=0) == [range(0, 3)]
