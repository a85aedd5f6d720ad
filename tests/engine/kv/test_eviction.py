"""Eviction policies on constructed histories: the order each one evicts in."""

import pytest

from chatfleet.engine.kv.block import BlockHint, KVBlock
from chatfleet.engine.kv.eviction_policies import EVICTION_POLICIES, make_eviction_policy
from chatfleet.engine.kv.pauses import SessionPauses
from chatfleet.errors import ConfigError


def hint(session=None, last_use=0.0, uses=1, sessions=1):
    return BlockHint(session, last_use, uses, sessions)


def drain(policy):
    out = []
    while len(policy):
        out.append(policy.pop().block_id)
    return out


def test_registry_holds_the_three_policies():
    assert EVICTION_POLICIES.names == ["lfu", "lru", "session"]
    with pytest.raises(ConfigError, match="lfu, lru, session"):
        make_eviction_policy("arc")


def test_lru_evicts_in_release_order_and_forgets_revived_blocks():
    p = make_eviction_policy("lru")
    blocks = [KVBlock(i) for i in range(4)]
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):
        p.add(b, hint())
    p.remove(blocks[0])
    assert drain(p) == [2, 3, 1]


def test_lfu_evicts_fewest_uses_first_then_oldest():
    p = make_eviction_policy("lfu")
    for i, uses in enumerate([5, 1, 3, 1, 9]):
        p.add(KVBlock(i), hint(uses=uses, last_use=float(i)))
    revived = KVBlock(1)
    p.remove(revived)  # block 1 was revived by a prefix hit
    p.add(KVBlock(1), hint(uses=2))
    assert sorted(b.block_id for b in p) == [0, 1, 2, 3, 4]
    assert drain(p) == [3, 1, 2, 0, 4]


def trained(clock, gap=60.0, sessions=10, turns=3):
    pauses = SessionPauses()
    p = make_eviction_policy("session", clock, pauses)
    t = 0.0
    for s in range(sessions):  # every session pauses `gap` seconds between turns
        name = f"train{s}"
        pauses.note_turn(name, t)
        for _ in range(turns - 1):
            p.add(KVBlock(10_000 + s), hint(name, t))  # its turn ends: its blocks are released
            p.remove(KVBlock(10_000 + s))  # and revived by its next turn
            t += gap
            pauses.note_turn(name, t)
    return p, t


def test_session_policy_learns_the_pause_and_keeps_chats_about_to_return():
    now = [0.0]
    p, t0 = trained(lambda: now[0])
    assert p.model.median == pytest.approx(60.0, rel=0.2) and p.model.p_continue > 0.5
    t = t0 + 10_000.0
    # "gone" ended an hour ago, "just" a second ago, "due" 55 s ago (about its usual pause)
    released = [(0, "gone", t - 3600), (2, "due", t - 55), (1, "just", t - 1)]  # in release order
    lru = make_eviction_policy("lru")
    for i, session, last in released:
        p.add(KVBlock(i), hint(session, last))
        lru.add(KVBlock(i), hint(session, last))
    now[0] = t
    assert drain(p) == [0, 1, 2]
    assert drain(lru) == [0, 2, 1]  # LRU gives up the chat that is about to come back


def test_session_policy_keeps_a_shared_card_over_a_private_tail():
    now = [1000.0]
    p, _ = trained(lambda: now[0])
    p.add(KVBlock(0), hint("a", 990.0, uses=6, sessions=5))  # a persona card
    p.add(KVBlock(1), hint("a", 990.0))  # a's own tail, released at the same time
    p.add(KVBlock(2), hint("b", 990.0))
    assert drain(p)[-1] == 0


def test_session_policy_evicts_a_sessions_blocks_tail_first_and_handles_revival():
    now = [100.0]
    p = make_eviction_policy("session", lambda: now[0])
    blocks = [KVBlock(i) for i in range(4)]
    for b in blocks[::-1]:  # a request releases tail first
        p.add(b, hint("s", 90.0))
    p.add(KVBlock(9), hint(None, 50.0))
    p.remove(blocks[3])  # revived
    order = drain(p)
    s_order = [i for i in order if i != 9]
    assert s_order == [2, 1, 0] and len(order) == 4


def test_pause_model_reuse_probability_shape():
    m = SessionPauses(prior_median=60.0, prior_sigma=0.3, prior_weight=100)
    for _ in range(50):
        m.observe_gap(None)
        m.observe_gap(60.0)
    soon, due, gone = (m.reuse_probability(t, m.median) for t in (1.0, 55.0, 5000.0))
    assert due > soon > gone >= 0.0
    assert m.reuse_probability(1.0, m.median, sharing=4) > soon


def test_both_pools_share_one_pause_model_learned_from_turns():
    from chatfleet.engine.kv.manager import PagedKVManager
    from chatfleet.engine.request import Request, SamplingParams

    now = [0.0]
    kv = PagedKVManager(8, 4, eviction_policy="session", num_host_blocks=8, host_eviction_policy="session",
                   clock=lambda: now[0])
    assert kv.pool._evictable.model is kv.pauses is kv.host_pool._evictable.model
    for turn in range(3):
        r = Request(f"t{turn}", list(range(9 + turn)), SamplingParams(max_tokens=1), session_id="s")
        kv.allocate(r, r.num_tokens, prefix=kv.match_prefix(r))
        r.num_computed_tokens = r.num_tokens
        kv.cache_computed(r)
        now[0] += 1.0
        kv.free(r.request_id)  # the turn ends
        now[0] += 40.0  # the user pauses
    assert kv.pauses.turns == 3 and kv.pauses.returns == 2
    assert kv.pauses.last_end("s") == 83.0  # the last release
