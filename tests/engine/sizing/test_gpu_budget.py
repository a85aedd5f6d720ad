"""--gpu-memory-utilization: the card's share less weights and profiled activations is the KV
pool; the planner's `plan memory --memory-fraction` split is the same function, so the engine
and the planner agree on the same inputs; the builder sizes a real engine's pool by it."""

import pytest

from chatfleet.engine.sizing.gpu_budget import GpuMemoryPlan, usable_bytes
from chatfleet.errors import ConfigError

MiB = 1 << 20


def test_usable_bytes_is_the_share_less_the_reserve():
    assert usable_bytes(1000 * MiB, 0.9, 100 * MiB) == 800 * MiB
    assert usable_bytes(10, 1.0, 0) == 10
    for fraction in (0.0, 1.01, -0.5):
        with pytest.raises(ConfigError):
            usable_bytes(10, fraction, 0)
    with pytest.raises(ConfigError):
        usable_bytes(10, 0.5, -1)


def test_the_plan_gives_the_pool_what_weights_and_activations_leave():
    plan = GpuMemoryPlan("cuda:0", 80_000 * MiB, 0.9, 16_000 * MiB, 3_000 * MiB, 2048)
    assert plan.kv_bytes == int(0.9 * 80_000 * MiB) - 3_000 * MiB - 16_000 * MiB
    assert "KV pool" in plan.describe() and "2048 tokens" in plan.describe()
    with pytest.raises(ConfigError, match="leaves no KV pool"):
        GpuMemoryPlan("cuda:0", 20_000 * MiB, 0.9, 16_000 * MiB, 3_000 * MiB, 2048).check()


def test_engine_and_planner_agree_on_a_card():
    from chatfleet.engine.sizing.memory import memory_breakdown
    from chatfleet.plan.catalog import load_catalog
    from chatfleet.plan.memory_report import budget_for

    hf = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
          "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
          "max_position_embeddings": 40960, "tie_word_embeddings": False}
    gpu = load_catalog().get("H100")
    reserve = 2500 * MiB
    planner = memory_breakdown(hf, dtype="bfloat16", budget_bytes=budget_for(gpu, 0.9, None, reserve))
    weights = planner.weight_bytes
    engine = GpuMemoryPlan("cuda:0", gpu.memory_bytes, 0.9, weights, reserve, 2048)
    assert engine.kv_bytes == planner.budget_bytes - weights  # one split, two callers
    assert abs(planner.kv_pool_bytes - engine.kv_bytes) < planner.kv_spec.groups[0].bytes_per_token * 16 * 2


class FakeProbe:
    def __init__(self, total: int, activations: int) -> None:
        self.total, self.activations, self.starts = total, activations, 0

    def total_bytes(self) -> int:
        return self.total

    def start(self) -> int:
        self.starts += 1
        return 1000

    def peak_bytes(self) -> int:
        return 1000 + self.activations


def test_the_builder_sizes_the_pool_from_a_profile_pass(monkeypatch, caplog):
    import logging

    import torch

    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig, engine_memory
    from chatfleet.engine.engine import Engine
    from chatfleet.engine.models.checkpoint import read_hf_config
    from chatfleet.engine.runner import memory_profile

    hf = read_hf_config(resolve_model("tiny"))
    weights = engine_memory(EngineConfig(model="tiny"), hf).weight_bytes
    per_block = engine_memory(EngineConfig(model="tiny"), hf).kv_spec.groups[0].bytes_per_token * 16
    total, activations = 4 * (weights + 50 * per_block), 7 * MiB // 4
    probe = FakeProbe(total, activations)
    monkeypatch.setattr(memory_profile, "probe_for", lambda device: probe)
    seen = []
    real = memory_profile.profile_activation_peak

    def spy(model, num_tokens, *args):
        seen.append(num_tokens)
        return real(model, num_tokens, *args)

    monkeypatch.setattr(memory_profile, "profile_activation_peak", spy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.INFO, logger="chatfleet.engine.builder"):
            engine = Engine(EngineConfig(model="tiny", device="auto", gpu_memory_utilization=0.5,
                                         cache=CacheConfig(block_size=16),
                                         scheduler=SchedulerConfig(max_batched_tokens=96)))
    finally:
        torch.set_num_threads(threads)
    want_kv = usable_bytes(total, 0.5, activations) - weights
    assert seen == [96] and probe.starts == 1
    assert engine.kv.num_blocks == want_kv // per_block
    assert "GPU memory: 0.5 x" in caplog.text and "reserved" in caplog.text
