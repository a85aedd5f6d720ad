"""The prefix-cache hit rate the engine would get from a sample of requests, sent one after the
other: the real engine (scheduler, KV manager, prefix cache and its block hashing) over a
``SimRunner`` in fast mode, a pool big enough that nothing is evicted, one output token each."""

from __future__ import annotations

from dataclasses import dataclass

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.plan.sim_replica import SIM_VOCAB, NullTokenizer


@dataclass(frozen=True)
class HitRate:
    prompt_tokens: int
    cached_tokens: int

    @property
    def rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def engine_hit_rate(prompts: list[list[int]], block_size: int = 16) -> HitRate:
    total = sum(len(p) + 1 for p in prompts)
    blocks = total // block_size + len(prompts) + 1
    runner = SimRunner(blocks, block_size, vocab_size=SIM_VOCAB, max_model_len=blocks * block_size,
                       check_contents=False)
    config = EngineConfig(model="prefix-check",
                          cache=CacheConfig(block_size=block_size, num_tokens=blocks * block_size),
                          scheduler=SchedulerConfig(max_batched_tokens=max(len(p) for p in prompts) + 1, max_running=1))
    engine = Engine(config, runner=runner, tokenizer=NullTokenizer())
    prompt_tokens = cached = 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    prompt_tokens += out.num_prompt_tokens
                    cached += out.num_cached_tokens
    return HitRate(prompt_tokens, cached)
