"""Engine on the SimRunner: admission errors, aborts, prefix reuse, stats, and randomized
workloads with integrity checks after every step and greedy equivalence with running alone."""

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sim_runner import BYTE_VOCAB_SIZE, SimRunner, make_byte_tokenizer
from chatfleet.errors import ConfigError, InvalidRequestError, RequestTooLongError, ServerOverloadedError

TOK = make_byte_tokenizer()
BS = 4


def make_engine(num_blocks=256, max_model_len=4096, prefix=True, **sched):
    config = EngineConfig(
        model="sim",
        cache=CacheConfig(block_size=BS, num_tokens=num_blocks * BS, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(**sched),
        max_model_len=max_model_len,
    )
    runner = SimRunner(num_blocks, BS, vocab_size=BYTE_VOCAB_SIZE, max_model_len=max_model_len)
    return Engine(config, runner=runner, tokenizer=TOK)


def greedy(**kw):
    kw.setdefault("max_tokens", 8)
    return SamplingParams(temperature=0.0, **kw)


@dataclass
class Result:
    tokens: list
    text: str
    finish_reason: str | None
    cached: int
    prompt_logprobs: list | None


def drain(engine, limit=2000):
    results: dict[str, Result] = {}
    steps = 0
    while engine.has_unfinished_requests():
        collect(engine.step(), results)
        engine.check_integrity()
        steps += 1
        assert steps < limit, "engine made no progress"
    assert_drained(engine)
    return results


def collect(outputs, results):
    for o in outputs:
        r = results.setdefault(o.request_id, Result([], "", None, o.num_cached_tokens, None))
        r.tokens += o.new_token_ids
        r.text += o.new_text
        if o.prompt_logprobs is not None:
            assert r.prompt_logprobs is None, "prompt logprobs sent twice"
            r.prompt_logprobs = o.prompt_logprobs
        if o.finished:
            assert r.finish_reason is None, "finished twice"
            r.finish_reason = o.finish_reason


def assert_drained(engine):
    engine.check_integrity()
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks), "a block is still in use"
    assert engine.kv.pool.num_free_blocks == engine.kv.num_blocks
    assert engine.stats().kv_usage == 0.0


def run_alone(prompt, params, **engine_kw):
    engine = make_engine(**engine_kw)
    engine.add_request("solo", prompt, params)
    return drain(engine)["solo"]


# ---- admission -----------------------------------------------------------------------------------

def test_bad_requests_fail_at_once_with_clear_errors():
    engine = make_engine(num_blocks=8, max_model_len=64, max_running=1, max_waiting=0)
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("a", [], greedy())
    with pytest.raises(InvalidRequestError, match="vocabulary") as exc:
        engine.add_request("a", [1, BYTE_VOCAB_SIZE], greedy())
    assert exc.value.status_code == 400
    with pytest.raises(RequestTooLongError, match="KV cache of 32"):
        engine.add_request("a", [1] * 30, greedy(max_tokens=3))
    with pytest.raises(RequestTooLongError, match="context length of 64"):
        make_engine(max_model_len=64).add_request("a", [1] * 60, greedy(max_tokens=5))
    engine.add_request("a", [1, 2], greedy())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", [1, 2], greedy())
    with pytest.raises(ServerOverloadedError):
        engine.add_request("b", [1, 2], greedy())
    engine.check_integrity()
    drain(engine)


def test_engine_needs_a_tokenizer_and_a_sane_context_length():
    runner = SimRunner(8, BS, max_model_len=100)
    with pytest.raises(ConfigError, match="tokenizer"):
        Engine(EngineConfig(model="sim", cache=CacheConfig(block_size=BS)), runner=runner)
    with pytest.raises(ConfigError, match="exceeds"):
        Engine(EngineConfig(model="sim", cache=CacheConfig(block_size=BS), max_model_len=200),
               runner=runner, tokenizer=TOK)
    engine = Engine(EngineConfig(model="sim", cache=CacheConfig(block_size=BS)), runner=runner, tokenizer=TOK)
    assert engine.max_model_len == 32 and engine.max_request_tokens == 32  # capped by the pool
    assert engine.model_name == "sim"


# ---- lifecycle -----------------------------------------------------------------------------------

def test_abort_frees_blocks_at_once_and_emits_nothing_more():
    engine = make_engine()
    engine.add_request("a", list(range(40)), greedy(max_tokens=50))
    engine.add_request("b", list(range(40)), greedy(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats().kv_usage > 0
    engine.abort_request("a")
    engine.abort_request("a")  # no-op
    engine.abort_request("never-seen")  # no-op
    engine.check_integrity()
    assert not engine.kv.has_blocks("a")
    results = drain(engine)
    assert "a" not in results and results["b"].finish_reason == "length"


def test_repeated_prompt_reports_cached_tokens_and_counters():
    prompt = TOK.encode("You are a helpful pirate. " * 4)
    engine = make_engine()
    engine.add_request("cold", prompt, greedy())
    cold = drain(engine)["cold"]
    engine.add_request("warm", prompt, greedy())
    warm = drain(engine)["warm"]
    assert cold.cached == 0
    assert warm.cached == (len(prompt) - 1) // BS * BS
    assert warm.tokens == cold.tokens
    s = engine.stats()
    assert s.prefix_cache_queries == 2 * len(prompt) and s.prefix_cache_hits == warm.cached
    assert s.prompt_tokens == 2 * len(prompt) and s.generation_tokens == 16 and s.num_finished == 2
    assert engine.reset_prefix_cache() is True
    engine.add_request("after-reset", prompt, greedy())
    assert drain(engine)["after-reset"].cached == 0


def test_no_prefix_cache_and_cache_salt_isolation():
    prompt = list(range(10, 50))
    off = make_engine(prefix=False)
    for rid in ("a", "b"):
        off.add_request(rid, prompt, greedy())
        assert drain(off)[rid].cached == 0
    on = make_engine()
    on.add_request("a", prompt, greedy(), cache_salt="alice")
    drain(on)
    on.add_request("b", prompt, greedy(), cache_salt="bob")
    on.add_request("c", prompt, greedy(), cache_salt="alice")
    res = drain(on)
    assert res["b"].cached == 0 and res["c"].cached > 0


def test_prompt_logprobs_are_complete_and_independent_of_chunking():
    prompt = list(range(60, 90))
    params = greedy(max_tokens=2, prompt_logprobs=1, logprobs=2)
    whole = run_alone(prompt, params)
    chunked = run_alone(prompt, params, max_batched_tokens=7)
    assert len(whole.prompt_logprobs) == len(prompt) and whole.prompt_logprobs[0] is None
    assert [lp.token_id for lp in whole.prompt_logprobs[1:]] == prompt[1:]
    assert chunked.prompt_logprobs == whole.prompt_logprobs
    # A prompt-logprobs request never reuses the prefix cache.
    engine = make_engine()
    engine.add_request("warm", prompt, greedy())
    drain(engine)
    engine.add_request("scored", prompt, params)
    assert drain(engine)["scored"].cached == 0


def test_seeded_sampling_is_reproducible_regardless_of_batch():
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = run_alone(list(range(5, 25)), params)
    engine = make_engine(max_batched_tokens=9)
    engine.add_request("x", list(range(5, 25)), params)
    for i in range(4):
        engine.add_request(f"o{i}", list(range(i, 30)), SamplingParams(max_tokens=10, seed=i))
    assert drain(engine)["x"].tokens == alone.tokens


def test_stop_string_finishes_request_and_frees_blocks():
    prompt = list(range(100, 140))
    base = run_alone(prompt, greedy(max_tokens=30, ignore_eos=True))
    stop = next(c for c in base.text[3:] if c.isascii() and c.isalnum())
    engine = make_engine()
    engine.add_request("s", prompt, greedy(max_tokens=30, ignore_eos=True, stop=(stop,)))
    res = drain(engine)["s"]
    assert res.finish_reason == "stop" and stop not in res.text
    assert res.text == base.text[: base.text.index(stop)] and len(res.tokens) < len(base.tokens)


# ---- randomized workloads ------------------------------------------------------------------------

SHARED = [TOK.encode("System: you are Aria, a cheerful bard. "), TOK.encode("System: terse. "), []]

request_st = st.fixed_dictionaries({
    "prefix": st.integers(0, 2),
    "suffix": st.integers(1, 20),
    "max_tokens": st.integers(1, 24),
    "arrive": st.integers(0, 4),
    "abort_at": st.one_of(st.none(), st.integers(0, 12)),
    "stop": st.booleans(),
    "ignore_eos": st.booleans(),
    "salt": st.sampled_from([None, None, "t1"]),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_st, min_size=3, max_size=12),
    num_blocks=st.integers(6, 32),
    budget=st.integers(2, 48),
    max_running=st.integers(1, 6),
    prefix=st.booleans(),
)
def test_randomized_workload_integrity_and_greedy_equivalence(reqs, num_blocks, budget, max_running, prefix):
    engine = make_engine(num_blocks=num_blocks, max_batched_tokens=budget, max_running=max_running,
                         prefix=prefix)
    specs, results, aborted = {}, {}, set()
    step = 0
    pending = sorted(enumerate(reqs), key=lambda x: x[1]["arrive"])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1]["arrive"] <= step:
            i, spec = pending.pop(0)
            rid = f"r{i}"
            prompt = SHARED[spec["prefix"]] + [(i * 31 + k * 7) % 250 for k in range(spec["suffix"])]
            params = greedy(max_tokens=spec["max_tokens"], ignore_eos=spec["ignore_eos"],
                            stop=("e",) if spec["stop"] else ())
            try:
                engine.add_request(rid, prompt, params, cache_salt=spec["salt"])
            except RequestTooLongError:
                assert len(prompt) + spec["max_tokens"] > num_blocks * BS
                continue
            specs[rid] = (prompt, params, spec)
        for rid, (_, _, spec) in specs.items():
            if spec["abort_at"] == step and engine.get_request(rid) is not None:
                engine.abort_request(rid)
                aborted.add(rid)
                assert not engine.kv.has_blocks(rid)
        collect(engine.step(), results)
        engine.check_integrity()
        step += 1
        assert step < 3000
    assert_drained(engine)
    s = engine.stats()
    assert s.prefix_cache_hits <= s.prefix_cache_queries
    for rid, (prompt, params, _spec) in specs.items():
        if rid in aborted:
            continue
        alone = run_alone(prompt, params)
        got = results[rid]
        assert got.tokens == alone.tokens, f"{rid} differs from running alone"
        assert got.text == alone.text and got.finish_reason == alone.finish_reason
