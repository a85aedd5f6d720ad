"""The replay runs the real engine on the SimRunner: with a pool that holds everything, each
turn's hit rate is exactly its history's full blocks; a pool that does not hold the working set
loses hits; memory stays consistent after every step."""

import pytest

from chatfleet.bench.replay import (
    ReplayConfig,
    ScriptTurn,
    SessionScript,
    TraceSpec,
    make_trace,
    replay,
    working_set_tokens,
)

BS = 16


def script(i, card_len=40, turns=((10, 12), (9, 20), (17, 5))):
    card = tuple((7 * i + k) % 256 for k in range(card_len))
    ts = tuple(ScriptTurn(tuple((11 * i + 3 * k + t) % 256 for k in range(u)), r, 0.0 if t == 0 else 2.0)
               for t, (u, r) in enumerate(turns))
    return SessionScript(f"s{i}", 0.5 * i, card, ts)


def test_ample_pool_hits_every_full_block_of_the_history():
    sessions = (script(0), script(1))
    res = replay(sessions, ReplayConfig(device_tokens=4096, block_size=BS), check_integrity=True)
    got = {(t.session_id, t.turn): (t.prompt_tokens, t.cached_tokens) for t in res.turns}
    for s in sessions:
        prompt = len(s.card_ids)
        prev_prompt = 0  # the previous turn's prompt length; read from the second turn on
        for ti, turn in enumerate(s.turns):
            prompt += len(turn.user_ids)
            if ti == 0:
                want_cached = 0  # distinct cards: nothing to hit
            else:
                computed = prev_prompt + s.turns[ti - 1].reply_tokens - 1  # the last reply token was never fed
                want_cached = computed // BS * BS
            assert got[(s.session_id, ti)] == (prompt, want_cached)
            prev_prompt = prompt
            prompt += turn.reply_tokens


def test_a_pool_smaller_than_the_working_set_loses_hits_and_stays_consistent():
    spec = TraceSpec(num_sessions=6, num_turns=4, num_cards=6, card_tokens=TraceSpec.card_tokens,
                     start_spread_s=2.0)
    sessions = make_trace(spec, seed=3)
    ws = working_set_tokens(sessions)
    ample = replay(sessions, ReplayConfig(device_tokens=4 * ws, block_size=BS))
    scarce = replay(sessions, ReplayConfig(device_tokens=ws // 3 // BS * BS, block_size=BS), check_integrity=True)
    assert len(ample.turns) == len(scarce.turns) == 6 * 4
    assert scarce.hit_rate < ample.hit_rate
    assert ample.hit_rate_by_turn()[3] > 0.8


def test_trace_is_deterministic_and_sized_between_the_two_pools():
    a, b = make_trace(TraceSpec(), 0), make_trace(TraceSpec(), 0)
    assert a == b and a != make_trace(TraceSpec(), 1)
    assert len(a) == 24
    for turn in (5, 6):
        assert 8192 < working_set_tokens(a, turn) < 16384
    assert working_set_tokens(a) == pytest.approx(working_set_tokens(b))
