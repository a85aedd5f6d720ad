"""Gemma 4 (sliding-window and full-attention layer groups, KV-sharing layers, MoE) through the
runner's kernels path on the CPU (the dispatchers' torch references, the experts grouped): the
same greedy tokens as the gather path, prompts past the 64-token window, batched and chunked."""

import pytest
import torch

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.torch_runner import TorchRunner


@pytest.fixture(scope="module")
def loaded():
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(resolve_model("tiny-gemma4-moe"), dtype="float32", kernels="torch")
    torch.set_num_threads(threads)


def generate(loaded, attention, max_batched_tokens):
    tok = loaded.tokenizer
    story = "Tell me a story about the sea. "
    prompts = [tok.encode_chat([{"role": "user", "content": story * k}]) for k in (1, 7, 14)]
    assert max(map(len, prompts)) > 64  # past the sliding window
    spec = loaded.config.kv_cache_spec(16, "float32")
    runner = TorchRunner(loaded, {g.name: 128 for g in spec.groups}, 16, attention=attention)
    assert runner.attention == attention
    config = EngineConfig(model="tiny-gemma4-moe", max_model_len=1024,
                          cache=CacheConfig(block_size=16, num_tokens=128 * 16),
                          scheduler=SchedulerConfig(max_batched_tokens=max_batched_tokens))
    engine = Engine(config, runner=runner, tokenizer=tok)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        engine.check_integrity()
    return out


@pytest.mark.parametrize("max_batched_tokens", [2048, 40])
def test_kernels_path_equals_gather_path(loaded, max_batched_tokens):
    gather = generate(loaded, "gather", max_batched_tokens)
    assert generate(loaded, "kernels", max_batched_tokens) == gather
    assert all(len(t) == 8 for t in gather.values())
