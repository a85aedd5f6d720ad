"""Replay multi-turn sessions through the real engine (scheduler, KV manager, eviction and
scheduling policies, host tier) on the ``SimRunner`` under a virtual clock.

Prefix-cache hit rates depend on which blocks the policies keep, not on how fast a forward pass
is, so the model is replaced by the SimRunner (a hash of the context it reads back from its KV
slots) and time by a step-cost model; everything else is the engine's own code path. A session
sends its card, its whole history (earlier prompts and the engine's own replies) and a new user
turn; after a reply ends it pauses, then sends the next turn. Each request's hit rate is the
``num_cached_tokens`` the engine reports (device and host hits) over its prompt tokens.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from chatfleet.bench.dists import Dist, make, zipf_weights
from chatfleet.errors import ConfigError

CARD_VOCAB = 256  # token ids of the scripts: bytes (the SimRunner's byte tokenizer)


@dataclass(frozen=True)
class ScriptTurn:
    user_ids: tuple[int, ...]
    reply_tokens: int
    pause_s: float  # before this turn, after the previous reply ended (0 for the first)


@dataclass(frozen=True)
class SessionScript:
    session_id: str
    start_s: float
    card_ids: tuple[int, ...]
    turns: tuple[ScriptTurn, ...]


@dataclass(frozen=True)
class TraceSpec:
    """The sessions of a replay: lengths in tokens, pauses in virtual seconds."""

    num_sessions: int = 24
    num_turns: int = 8
    num_cards: int = 24
    zipf_s: float = 1.0
    card_tokens: Dist = make("uniform", low=160, high=224)
    user_tokens: Dist = make("uniform", low=16, high=32)
    reply_tokens: Dist = make("uniform", low=32, high=48)
    pause_s: Dist = make("lognormal", mean=8.0, sigma=0.5, min=1.0, max=60.0)
    start_spread_s: float = 8.0  # first turns spread uniformly over this window

    def __post_init__(self) -> None:
        if min(self.num_sessions, self.num_turns, self.num_cards) < 1:
            raise ConfigError("a replay needs at least one session, turn and card")


def make_trace(spec: TraceSpec, seed: int = 0) -> tuple[SessionScript, ...]:
    """Seeded sessions: cards shared by Zipf popularity, random byte tokens for the text."""
    rng = random.Random(f"replay:{seed}")
    cards = [tuple(rng.randrange(CARD_VOCAB) for _ in range(spec.card_tokens.sample_int(rng)))
             for _ in range(spec.num_cards)]
    weights = zipf_weights(spec.num_cards, spec.zipf_s)
    sessions = []
    for i in range(spec.num_sessions):
        card = rng.choices(cards, weights=weights)[0]
        turns = tuple(ScriptTurn(tuple(rng.randrange(CARD_VOCAB) for _ in range(spec.user_tokens.sample_int(rng))),
                                 spec.reply_tokens.sample_int(rng), 0.0 if t == 0 else spec.pause_s.sample(rng))
                      for t in range(spec.num_turns))
        sessions.append(SessionScript(f"s{i}", rng.uniform(0, spec.start_spread_s), card, turns))
    return tuple(sessions)


def working_set_tokens(sessions: tuple[SessionScript, ...], upto_turn: int | None = None) -> int:
    """Tokens of all sessions' contexts after ``upto_turn`` (default: the last), cards counted once."""
    cards = {s.card_ids for s in sessions}
    total = sum(len(c) for c in cards)
    for s in sessions:
        last = len(s.turns) if upto_turn is None else min(upto_turn + 1, len(s.turns))
        total += sum(len(t.user_ids) + t.reply_tokens for t in s.turns[:last])
    return total


@dataclass(frozen=True)
class StepCost:
    """Virtual seconds per engine step: a fixed part, per batched token, per block moved."""

    fixed_s: float = 0.02
    per_token_s: float = 0.0006
    per_block_moved_s: float = 0.00002

    def __call__(self, plan) -> float:
        moved = sum(t.num_blocks for t in plan.kv_transfers)
        return self.fixed_s + self.per_token_s * plan.num_batched_tokens + self.per_block_moved_s * moved


@dataclass(frozen=True)
class ReplayConfig:
    device_tokens: int
    host_tokens: int = 0
    eviction_policy: str = "lru"
    host_eviction_policy: str = "lru"
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    max_batched_tokens: int = 2048
    max_running: int = 256
    cost: StepCost = field(default_factory=StepCost)

    def __post_init__(self) -> None:
        if self.device_tokens < self.block_size or self.host_tokens < 0:
            raise ConfigError("the device pool needs at least one block and the host pool >= 0 tokens")

    @property
    def label(self) -> str:
        host = f" + host {self.host_tokens:,} ({self.host_eviction_policy})" if self.host_tokens else ""
        return f"{self.eviction_policy} @ {self.device_tokens:,}{host}"


@dataclass(frozen=True)
class TurnResult:
    session_id: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    pause_s: float | None
    ttft_s: float  # virtual: arrival to first token

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class ReplayResult:
    config: ReplayConfig
    turns: tuple[TurnResult, ...]
    virtual_s: float
    steps: int

    def hit_rate_by_turn(self) -> dict[int, float]:
        """Token-weighted hit rate per turn index."""
        acc: dict[int, list[int]] = {}
        for t in self.turns:
            a = acc.setdefault(t.turn, [0, 0])
            a[0] += t.cached_tokens
            a[1] += t.prompt_tokens
        return {k: acc[k][0] / acc[k][1] for k in sorted(acc) if acc[k][1]}

    @property
    def hit_rate(self) -> float:
        prompt = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0


def replay(sessions: tuple[SessionScript, ...], cfg: ReplayConfig, check_integrity: bool = False) -> ReplayResult:
    """Run every session to its end through an Engine with a SimRunner; virtual time throughout."""
    from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from chatfleet.engine.engine import Engine
    from chatfleet.engine.request import SamplingParams
    from chatfleet.engine.runner.sim_runner import BYTE_VOCAB_SIZE, SimRunner, make_byte_tokenizer

    bs = cfg.block_size
    num_blocks, num_host_blocks = cfg.device_tokens // bs, cfg.host_tokens // bs
    max_len = num_blocks * bs
    runner = SimRunner(num_blocks, bs, vocab_size=BYTE_VOCAB_SIZE, max_model_len=max_len, cost_model=cfg.cost,
                       num_host_blocks=num_host_blocks)
    config = EngineConfig(
        model="sim", max_model_len=max_len,
        cache=CacheConfig(block_size=bs, num_tokens=num_blocks * bs, eviction_policy=cfg.eviction_policy,
                          host_eviction_policy=cfg.host_eviction_policy),
        scheduler=SchedulerConfig(max_batched_tokens=cfg.max_batched_tokens, max_running=cfg.max_running,
                                  policy=cfg.scheduling_policy),
    )
    engine = Engine(config, runner=runner, tokenizer=make_byte_tokenizer(), clock=lambda: runner.virtual_time)
    history: dict[str, list[int]] = {}
    arrivals: list[tuple[float, int, int, int]] = []  # (time, seq, session index, turn)
    for i, s in enumerate(sessions):
        heapq.heappush(arrivals, (s.start_s, i, i, 0))
    seq = len(sessions)
    inflight: dict[str, tuple[int, int, float, int]] = {}  # rid -> (session, turn, arrival, prompt len)
    results: list[TurnResult] = []
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= runner.virtual_time:
            at, _, i, t = heapq.heappop(arrivals)
            s = sessions[i]
            prompt = history.setdefault(s.session_id, list(s.card_ids))
            prompt.extend(s.turns[t].user_ids)
            rid = f"{s.session_id}-t{t}"
            n = s.turns[t].reply_tokens
            engine.add_request(rid, list(prompt), SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0,
                                                                 ignore_eos=True),
                               arrival_time=at, session_id=s.session_id)
            inflight[rid] = (i, t, at, len(prompt))
        if not engine.has_unfinished_requests():
            runner.virtual_time = max(runner.virtual_time, arrivals[0][0])
            continue
        for out in engine.step():
            i, t, at, plen = inflight[out.request_id]
            s = sessions[i]
            if out.num_output_tokens == len(out.new_token_ids):  # the request's first output
                results.append(TurnResult(s.session_id, t, plen, out.num_cached_tokens,
                                          s.turns[t].pause_s if t > 0 else None, runner.virtual_time - at))
            history[s.session_id].extend(out.new_token_ids)
            if out.finished:
                del inflight[out.request_id]
                if t + 1 < len(s.turns):
                    seq += 1
                    heapq.heappush(arrivals, (runner.virtual_time + s.turns[t + 1].pause_s, seq, i, t + 1))
        if check_integrity:
            engine.check_integrity()
    return ReplayResult(cfg, tuple(results), runner.virtual_time, runner.num_steps)
