"""Randomized concurrent chat workloads with a small device pool and a small host tier (both
near full), every eviction and scheduling policy: integrity of both pools after every step,
every block free or cached after the drain, and each greedy output equal to computing it alone
(the SimRunner's output hashes the context it reads back from KV, so a wrong reload shows).
A soak: many sessions whose working set is about twice device + host."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sim_runner import (
    BYTE_VOCAB_SIZE,
    SimRunner,
    make_byte_tokenizer,
)

TOK = make_byte_tokenizer()
BS = 4
CARDS = [[(7 * c + k) % 200 + 20 for k in range(10 + 3 * c)] for c in range(3)]  # shared personas


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_engine(num_blocks, num_host_blocks, eviction="lru", host_eviction="lru", policy="fcfs",
                clock=None, **sched):
    config = EngineConfig(
        model="sim", max_model_len=512,
        cache=CacheConfig(block_size=BS, num_tokens=num_blocks * BS, eviction_policy=eviction,
                          host_eviction_policy=host_eviction),
        scheduler=SchedulerConfig(policy=policy, max_queue_delay=0.5, **sched),
    )
    runner = SimRunner(num_blocks, BS, vocab_size=BYTE_VOCAB_SIZE, max_model_len=512,
                       num_host_blocks=num_host_blocks)
    return Engine(config, runner=runner, tokenizer=TOK, clock=clock or Clock())


def alone(prompt, params):
    engine = make_engine(256, 0)
    engine.add_request("x", prompt, params)
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
    return out


def check_drained(engine):
    engine.check_integrity()
    for pool in (engine.kv.pool, engine.kv.host_pool):
        if pool is not None:
            assert pool.num_used_blocks == 0
            assert all(b.ref_cnt == 0 for b in pool.blocks)
            assert pool.num_free_blocks == pool.num_blocks  # every block free or cached


turn = st.tuples(st.integers(0, 5), st.integers(0, 2), st.integers(1, 12), st.integers(1, 5),
                 st.integers(0, 3))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(turns=st.lists(turn, min_size=4, max_size=18), device=st.integers(12, 28), host=st.integers(1, 24),
       eviction=st.sampled_from(["lru", "lfu", "session"]), host_eviction=st.sampled_from(["lru", "lfu", "session"]),
       policy=st.sampled_from(["fcfs", "lpm"]), budget=st.sampled_from([7, 16, 64]))
def test_randomized_sessions_keep_both_pools_intact_and_outputs_exact(
        turns, device, host, eviction, host_eviction, policy, budget):
    clock = Clock()
    engine = make_engine(device, host, eviction, host_eviction, policy, clock, max_batched_tokens=budget)
    history: dict[int, list[int]] = {}
    expected, got = {}, {}
    for i, (session, card, new_len, max_tokens, gap) in enumerate(turns):
        prompt = history.get(session, CARDS[card]) + [(31 * i + k) % 200 + 20 for k in range(new_len)]
        if len(prompt) + max_tokens > device * BS:
            prompt = prompt[-(device * BS - max_tokens):]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        rid = f"t{i}"
        engine.add_request(rid, prompt, params, session_id=f"s{session}")
        expected[rid] = alone(prompt, params)
        got[rid] = []
        history[session] = prompt
        for _ in range(gap):  # requests overlap: the next turn arrives while this one runs
            clock.now += 0.1
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
            engine.check_integrity()
    while engine.has_unfinished_requests():
        clock.now += 0.1
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
        engine.check_integrity()
    assert got == expected
    check_drained(engine)


def test_soak_working_set_twice_device_plus_host_stays_bounded_and_finishes():
    clock = Clock()
    device, host = 24, 24  # 192 tokens in all
    engine = make_engine(device, host, "session", "session", "lpm", clock, max_batched_tokens=32)
    sessions = {s: list(CARDS[s % 3]) for s in range(12)}  # each grows to ~40 tokens: ~2x 192
    finished = 0
    submitted = 0
    for rnd in range(6):
        for s in sessions:
            sessions[s] = (sessions[s] + [(s * 13 + rnd * 7 + k) % 200 + 20 for k in range(4)])[-40:]
            engine.add_request(f"s{s}r{rnd}", sessions[s],
                               SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                               session_id=f"s{s}")
            submitted += 1
            clock.now += 0.05
            for o in engine.step():
                finished += o.finished
            engine.check_integrity()
            assert engine.kv.pool.num_used_blocks <= device
        while engine.has_unfinished_requests():
            clock.now += 0.05
            for o in engine.step():
                finished += o.finished
            engine.check_integrity()
        clock.now += 2.0  # the users pause
    assert finished == submitted
    stats = engine.stats()
    assert stats.host_demotions > 0 and stats.host_promotions > 0 and stats.host_evictions > 0
    check_drained(engine)
