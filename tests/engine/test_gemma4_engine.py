"""The engine serving tiny Gemma 4 models: greedy outputs equal transformers' generate, batched
and chunked, with prompts longer than the sliding window."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.builtin_models.tiny_gemma4 import build_named
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams

MAX_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small models run faster on one thread (and do not fight other processes for cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def run_chats(folder, *, budget, prefix_caching, keep=True, memory=400 * 1024, fraction=0.6):
    """Three two-turn chats (the second turn extends the first) on small per-group pools."""
    engine = Engine(EngineConfig(
        model=str(folder), kernels="torch",
        cache=CacheConfig(block_size=16, memory_bytes=memory, enable_prefix_caching=prefix_caching,
                          sliding_memory_fraction=fraction, keep_slid_out_blocks=keep),
        scheduler=SchedulerConfig(max_batched_tokens=budget)))
    gen = torch.Generator().manual_seed(11)
    vocab = engine.vocab_size
    persona = torch.randint(3, vocab, (40,), generator=gen).tolist()
    firsts = {f"c{i}": persona + torch.randint(3, vocab, (60 + 30 * i,), generator=gen).tolist() for i in range(3)}
    follow = {c: torch.randint(3, vocab, (20,), generator=gen).tolist() for c in firsts}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for cid, prompt in firsts.items():
        engine.add_request(f"{cid}/0", prompt, params)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            cid, turn = o.request_id.split("/")
            if o.finished and turn == "0":
                engine.add_request(f"{cid}/1", firsts[cid] + out[o.request_id] + follow[cid], params)
        engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and engine.kv.usage == 0.0
    return out, stats


def test_greedy_identical_with_caching_chunking_and_preemption(moe_folder):
    """Per-group pools (sliding and full) near full: outputs equal with prefix caching on (slid-out
    blocks kept or freed) and off, across chunk sizes; preemptions and prefix hits happen."""
    reference, _ = run_chats(moe_folder, budget=32, prefix_caching=False)
    preemptions = hits = 0
    for budget, caching, keep in ((64, True, True), (32, True, False)):
        got, stats = run_chats(moe_folder, budget=budget, prefix_caching=caching, keep=keep)
        assert got == reference, (budget, caching, keep)
        preemptions += stats.num_preemptions
        hits += stats.prefix_cache_hits
    assert preemptions > 0 and hits > 0
