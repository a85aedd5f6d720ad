"""HybridKVManager: a pool per layer group, windows released, the two-step hit rule, and
randomized multi-turn workloads (prefix caching on, both pools near full, preemption) under the
real scheduler with a content oracle and ``check_integrity()`` after every step.

The oracle stands in for the runner: it remembers what each slot of each group's pool holds (the
identity of the token *and its whole prefix*, as KV depends on both) and checks that every
position a query can see (its window, or everything for full attention) holds exactly this
request's KV. A shared pool or a wrong hit (the crash this replaces) fails it at once.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatfleet.engine.config import SchedulerConfig
from chatfleet.engine.kv.hybrid import HybridKVManager
from chatfleet.engine.kv.spec import GroupPool, LayerGroupSpec, PoolPlan
from chatfleet.engine.outputs import RunnerOutput, SampledToken, SchedulerOutput
from chatfleet.engine.request import Request, SamplingParams
from chatfleet.engine.scheduler import Scheduler

BS = 4
WINDOW = 8


def _plan(full_blocks: int, sliding_blocks: int, window: int = WINDOW) -> PoolPlan:
    full = LayerGroupSpec("full", (1,), 1, 8, BS)
    sliding = LayerGroupSpec("sliding", (0,), 2, 8, BS, sliding_window=window)
    return PoolPlan((GroupPool(full, full_blocks), GroupPool(sliding, sliding_blocks)))


def _req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _compute(kv, req, n, prefix=None):
    got = kv.allocate(req, n, prefix=prefix)
    if got is None:
        return None
    if prefix is not None:
        req.num_computed_tokens = prefix.num_tokens
    req.num_computed_tokens += n
    kv.cache_computed(req)
    return got


def _live(kv, rid, group):
    return [b for b in kv.group_block_ids(rid)[group]]


def test_sliding_group_keeps_only_its_window():
    kv = HybridKVManager(_plan(32, 32))
    r = _req("a", range(40))
    _compute(kv, r, 40, kv.match_prefix(r))
    kv.check_integrity()
    sliding = kv.groups[1].pool
    assert sliding.num_used_blocks == 10  # the whole chunk was written in one step
    r.output_token_ids.append(7)
    _compute(kv, r, 1)  # position 40 sees 33..40: blocks 8..10
    kv.check_integrity()
    assert sliding.num_used_blocks == 3 and kv.groups[0].pool.num_used_blocks == 11
    assert len(kv.group_block_ids("a")["sliding"]) == len(kv.block_ids("a")) == 11
    assert sliding.num_cached_blocks == 10  # slid-out blocks stay cached (evictable)


def test_slid_out_blocks_freed_when_not_kept():
    kv = HybridKVManager(_plan(32, 32), keep_slid_out_blocks=False)
    r = _req("a", range(40))
    _compute(kv, r, 40, kv.match_prefix(r))
    r.output_token_ids.append(7)
    _compute(kv, r, 1)
    kv.check_integrity()
    assert kv.groups[1].pool.num_cached_blocks == 2  # only blocks 8 and 9 (10 is not full)


def test_two_step_hit_rule():
    """Full attention hits 24 tokens; the sliding group must hold its window before the hit."""
    for keep, expected in ((True, 24), (False, 0)):
        kv = HybridKVManager(_plan(64, 64), keep_slid_out_blocks=keep)
        a = _req("a", range(40))
        _compute(kv, a, 40, kv.match_prefix(a))
        a.output_token_ids.append(7)
        _compute(kv, a, 1)  # slides blocks 0..7 out
        kv.free("a")
        b = _req("b", list(range(24)) + [900 + i for i in range(10)])
        m = kv.match_prefix(b)
        assert m.num_tokens == expected, keep
        # the same turn continued: the window before token 40 is still cached either way
        c = _req("c", list(range(40)) + [7, 8, 9])
        assert kv.match_prefix(c).num_tokens == 40
        got = _compute(kv, c, 3, kv.match_prefix(c))
        assert got.num_hit_blocks == 10
        sliding = kv._requests["c"][1].blocks  # the window before position 40: blocks 8 and 9 only
        assert sliding[:8] == [None] * 8 and None not in sliding[8:]
        assert None not in kv._requests["c"][0].blocks
        kv.check_integrity()


def test_allocation_is_all_or_nothing():
    kv = HybridKVManager(_plan(16, 3))
    a = _req("a", range(9))
    assert _compute(kv, a, 9, kv.match_prefix(a)) is not None  # 3 blocks in each pool
    b = _req("b", range(100, 104))
    assert kv.allocate(b, 4, prefix=kv.match_prefix(b)) is None  # sliding is full
    assert not kv.has_blocks("b") and kv.groups[0].pool.num_used_blocks == 3
    kv.check_integrity()


# ---- randomized multi-turn workloads under the scheduler --------------------------------------
class OracleRunner:
    """Checks every slot a query reads holds this request's KV, writes the new ones, samples a
    deterministic token per (request, position)."""

    def __init__(self, plan: PoolPlan, requests: dict[str, Request]) -> None:
        self.groups = [(p.group.name, p.group.sliding_window) for p in plan.pools]
        self.slots: dict[str, dict[int, tuple]] = {name: {} for name, _ in self.groups}
        self.requests = requests  # the scheduler's: each request's whole token sequence

    def _identity(self, rid: str, pos: int) -> tuple:
        return tuple(self.requests[rid].all_token_ids[: pos + 1])

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sampled = {}
        for c in out.chunks:
            seq = self.requests[c.request_id].all_token_ids
            assert seq[c.start_position : c.context_length] == c.token_ids
            tables = c.group_block_tables or {name: c.block_table for name, _ in self.groups}
            for name, window in self.groups:
                table, slots = tables[name], self.slots[name]
                for i in range(c.num_tokens):  # write first: a chunk attends to itself
                    p = c.start_position + i
                    slots[table[p // BS] * BS + p % BS] = self._identity(c.request_id, p)
                for i in range(c.num_tokens):
                    q = c.start_position + i
                    lo = 0 if window is None else max(0, q - window + 1)
                    for p in range(lo, q + 1):
                        got = slots.get(table[p // BS] * BS + p % BS)
                        assert got == self._identity(c.request_id, p), (c.request_id, name, q, p)
            if c.sample:
                token = hash((c.request_id.split("/")[0], c.context_length)) % 50
                sampled[c.request_id] = SampledToken(token)
        return RunnerOutput(sampled=sampled)


@st.composite
def workloads(draw):
    budget = draw(st.sampled_from([5, 16, 48]))
    least = -(-(budget + WINDOW - 1) // BS) + 1  # a chunk written whole and the window before it
    return dict(
        seed=draw(st.integers(0, 10_000)),
        num_chats=draw(st.integers(2, 6)),
        turns=draw(st.integers(1, 3)),
        full_blocks=draw(st.integers(24, 48)),  # the longest conversation fits alone
        sliding_blocks=draw(st.integers(least, least + 8)),
        budget=budget,
        keep=draw(st.booleans()),
    )


def run_workload(w, prefix_caching=True):
    rng = random.Random(w["seed"])
    plan = _plan(w["full_blocks"], w["sliding_blocks"])
    kv = HybridKVManager(plan, enable_prefix_caching=prefix_caching, keep_slid_out_blocks=w["keep"])
    sched = Scheduler(SchedulerConfig(max_batched_tokens=w["budget"], max_running=8), kv, max_model_len=10_000)
    runner = OracleRunner(plan, sched.requests)
    persona = [rng.randrange(50) for _ in range(rng.randint(4, 14))]
    chats = {f"c{i}": persona + [rng.randrange(50) for _ in range(rng.randint(1, 12))] for i in range(w["num_chats"])}
    turn = {cid: 0 for cid in chats}
    outputs: dict[str, list[int]] = {}
    live: dict[str, Request] = {}
    for cid, prompt in chats.items():
        live[cid] = _req(f"{cid}/0", prompt, max_tokens=rng.randint(1, 6))
        sched.add_request(live[cid])
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        result = runner.execute(out)
        sched.update(out, result)
        sched.check_integrity()
        steps += 1
        assert steps < 5_000
        for cid, r in list(live.items()):
            if r.request_id not in sched.requests:  # finished: the next turn extends it
                outputs[r.request_id] = list(r.output_token_ids)
                del live[cid]
                turn[cid] += 1
                if turn[cid] < w["turns"]:  # the same next turn whatever order chats finish in
                    crng = random.Random(f"{w['seed']}/{cid}/{turn[cid]}")
                    prompt = r.all_token_ids + [crng.randrange(50) for _ in range(crng.randint(1, 10))]
                    live[cid] = _req(f"{cid}/{turn[cid]}", prompt, max_tokens=crng.randint(1, 6))
                    sched.add_request(live[cid])
    for g in kv.groups:
        assert g.pool.num_used_blocks == 0
    return outputs, sched.num_preemptions


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(workloads())
def test_randomized_workloads_keep_integrity(w):
    cached, _ = run_workload(w, prefix_caching=True)
    uncached, _ = run_workload(w, prefix_caching=False)
    assert cached == uncached


def test_max_step_tokens_fits_a_chunk_and_its_window():
    kv = HybridKVManager(_plan(64, 10))
    fit = kv.max_step_tokens()
    assert fit == 9 * BS - WINDOW + 1
    r = _req("a", range(100))
    assert _compute(kv, r, fit, kv.match_prefix(r)) is not None  # alone, one step of that size fits
    kv.check_integrity()


def test_block_counts_ahead_of_allocation_match_what_allocate_takes():
    """``new_blocks_needed`` / ``free_blocks_needed`` (the KVManager protocol's counts, which the
    decode span relies on) against the blocks each group's pool actually gives up."""
    kv = HybridKVManager(_plan(256, 256))
    rng = random.Random(5)
    shared = [rng.randrange(1, 50) for _ in range(24)]
    hits = 0
    for i in range(30):
        tokens = shared[: rng.randrange(0, 25)] + [rng.randrange(1, 50) for _ in range(rng.randrange(2, 16))]
        r = Request(f"r{i}", tokens, SamplingParams())
        prefix = kv.match_prefix(r)
        hits += prefix.num_tokens
        n = r.num_tokens - prefix.num_tokens
        expect = kv.free_blocks_needed(r, n, prefix)
        before = [g.pool.num_free_blocks for g in kv.groups]
        assert kv.allocate(r, n, prefix=prefix) is not None
        assert expect == max(b - g.pool.num_free_blocks for b, g in zip(before, kv.groups, strict=True))
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed(r)
        for _ in range(rng.randrange(1, 12)):  # decode: one token at a time
            r.output_token_ids.append(rng.randrange(1, 50))
            expect = kv.new_blocks_needed(r, 1)
            before = [g.pool.num_free_blocks for g in kv.groups]
            kv._release_slid_out(kv._requests[r.request_id], r.num_computed_tokens)
            released = [g.pool.num_free_blocks - b for b, g in zip(before, kv.groups, strict=True)]
            before = [g.pool.num_free_blocks for g in kv.groups]
            assert kv.allocate(r, 1) is not None
            taken = [b - g.pool.num_free_blocks for b, g in zip(before, kv.groups, strict=True)]
            assert expect == max(taken), (released, taken)
            r.num_computed_tokens += 1
            kv.cache_computed(r)
        kv.check_integrity()
        if i % 3:  # a third stay: later requests hit their blocks (and revive the freed ones')
            kv.free(r.request_id)
    assert hits > 0


def test_stats_sum_every_group():
    kv = HybridKVManager(_plan(32, 32))
    r = Request("a", list(range(1, 30)), SamplingParams())
    kv.allocate(r, r.num_tokens)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed(r)
    s = kv.stats()
    assert s.num_cached_blocks == sum(g.pool.num_cached_blocks for g in kv.groups) > 0
    assert s.num_blocks == kv.num_blocks and s.usage == kv.usage and s.host is None
