"""The host tier end to end on the SimRunner (a content oracle: the sampled token hashes the
whole context read back from KV slots): device evictions demote blocks to host memory, a
returning conversation reloads them, and its greedy output equals computing it cold."""

from chatfleet.engine.config import CacheConfig, EngineConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.outputs import TransferDirection
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sim_runner import (
    BYTE_VOCAB_SIZE,
    SimRunner,
    make_byte_tokenizer,
)

TOK = make_byte_tokenizer()
BS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(num_blocks, num_host_blocks=0, **cache):
    config = EngineConfig(model="sim", max_model_len=512,
                          cache=CacheConfig(block_size=BS, num_tokens=num_blocks * BS, **cache))
    runner = SimRunner(num_blocks, BS, vocab_size=BYTE_VOCAB_SIZE, max_model_len=512,
                       num_host_blocks=num_host_blocks)
    return Engine(config, runner=runner, tokenizer=TOK)


def run(engine, rid, prompt, session=None):
    engine.add_request(rid, prompt, PARAMS, session_id=session)
    out, cached = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
        engine.check_integrity()
    return out, cached


def conversation(i, n=40):
    return [(17 * i + 3 * k) % 250 + 1 for k in range(n)]


def test_returning_turn_reloads_from_host_and_matches_cold():
    cold = {i: run(make_engine(64), f"c{i}", conversation(i))[0] for i in range(4)}
    engine = make_engine(16, num_host_blocks=64)  # the device holds one conversation at a time
    for i in range(4):
        assert run(engine, f"a{i}", conversation(i), f"s{i}")[0] == cold[i]
    stats = engine.stats()
    assert stats.host_demotions > 0 and stats.kv_bytes_stored > 0
    got, cached = run(engine, "back0", conversation(0), "s0")  # long evicted from the device
    assert got == cold[0]
    stats = engine.stats()
    assert stats.host_promotions > 0 and stats.host_cache_hits >= cached - BS > 0
    assert stats.kv_bytes_loaded > 0
    engine.check_integrity()
    assert engine.kv.pool.num_used_blocks == 0 and engine.kv.host_pool.num_used_blocks == 0


def test_without_host_tier_the_returning_turn_recomputes():
    engine = make_engine(16)
    for i in range(4):
        run(engine, f"a{i}", conversation(i))
    _, cached = run(engine, "back0", conversation(0))
    assert cached == 0 and engine.stats().host_promotions is None


def test_plan_carries_stores_before_loads_and_pins_host_blocks():
    engine = make_engine(12, num_host_blocks=32)
    run(engine, "a", conversation(0))
    run(engine, "b", conversation(1))  # evicts a's blocks: stores
    engine.add_request("back", conversation(0), PARAMS)
    plan = engine.scheduler.schedule()
    kinds = [t.direction for t in plan.kv_transfers]
    assert TransferDirection.LOAD in kinds
    assert kinds == sorted(kinds, key=lambda d: d != TransferDirection.STORE)
    host = engine.kv.host_pool
    loads = [t for t in plan.kv_transfers if t.direction == TransferDirection.LOAD]
    assert all(host.blocks[h].ref_cnt > 0 for t in loads for h in t.host_block_ids)  # pinned
    engine.kv.check_integrity()
    result = engine.runner.execute(plan)
    engine.scheduler.update(plan, result)
    assert all(host.blocks[h].ref_cnt == 0 for t in loads for h in t.host_block_ids)
    engine.check_integrity()


def test_metrics_export_host_tier_under_chatfleet_and_vllm_names():
    from chatfleet.engine.api.metrics import ServerMetrics

    engine = make_engine(16, num_host_blocks=64)
    for i in range(4):
        run(engine, f"a{i}", conversation(i))
    run(engine, "back", conversation(0))
    text = ServerMetrics("sim").render(engine.stats(), alive=True, open_requests=0).decode()
    for name in ("chatfleet:host_cache_hits_total", "chatfleet:host_cache_misses_total",
                 "chatfleet:host_cache_promotions_total", "chatfleet:host_cache_demotions_total",
                 "vllm:kv_offload_load_bytes_total", "vllm:kv_offload_store_time_total",
                 "vllm:external_prefix_cache_hits_total", "vllm:kv_offload_cpu_cache_usage_perc"):
        assert f'{name}{{model_name="sim"}}' in text, name
    hits = next(line for line in text.splitlines() if line.startswith("chatfleet:host_cache_hits_total"))
    assert float(hits.split()[-1]) == engine.stats().host_cache_hits > 0
    plain = ServerMetrics("sim").render(make_engine(16).stats(), alive=True, open_requests=0).decode()
    assert "host_cache" not in plain and "kv_offload" not in plain


def test_reset_prefix_cache_empties_both_tiers():
    engine = make_engine(16, num_host_blocks=64)
    for i in range(4):
        run(engine, f"a{i}", conversation(i))
    assert engine.kv.host_pool.num_cached_blocks > 0
    assert engine.reset_prefix_cache() is True
    assert engine.kv.host_pool.num_cached_blocks == 0 and engine.kv.pool.num_cached_blocks == 0
    _, cached = run(engine, "back0", conversation(0))
    assert cached == 0
    engine.check_integrity()
