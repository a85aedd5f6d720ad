"""The engine serving tiny Gemma 4 models: greedy outputs equal transformers' generate, batched
and chunked, with prompts longer than the sliding window."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams
from chatfleet.models.tiny_gemma4 import build_named

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory):
    return build_named("tiny-gemma4-moe", tmp_path_factory.mktemp("g4") / "m")


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (150, 70, 9)]


def run_engine(folder, prompts, *, budget=2048, prefix_caching=True, num_tokens=4096, block_size=16):
    engine = Engine(EngineConfig(
        model=str(folder), kernels="torch",
        cache=CacheConfig(block_size=block_size, num_tokens=num_tokens, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_batched_tokens=budget)))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()
    return [out[str(i)] for i in range(len(prompts))]


def test_greedy_matches_transformers(moe_folder):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_folder, dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    expected = []
    for p in prompts:
        with torch.inference_mode():
            seq = hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              min_new_tokens=MAX_TOKENS)
        expected.append(seq[0, len(p):].tolist())
    assert run_engine(moe_folder, prompts) == expected
    assert run_engine(moe_folder, prompts, budget=40) == expected  # chunked prefill, mixed batches
