"""A returning turn gets the previous turn's block hashes only where the engine would compute the
same ones (oracle: the engine's own hashing of the new prompt)."""

from __future__ import annotations

import random

from chatfleet.engine.block_hash import extend_block_hashes
from chatfleet.engine.request import Request, SamplingParams
from chatfleet.plan.session_hashes import SessionHashes

BS = 4


def _request(rid: str, prompt: list[int], outputs: list[int] = ()) -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=8), arrival_time=0.0)
    r.output_token_ids = list(outputs)
    extend_block_hashes(r.block_hashes, r.all_token_ids[: (r.num_tokens - 1) // BS * BS], BS)
    return r


def test_primed_hashes_are_the_engines_own():
    rng = random.Random(1)
    card = [rng.randrange(1000, 9000) for _ in range(21)]
    user1 = [rng.randrange(1000, 9000) for _ in range(6)]
    reply1 = [rng.randrange(1000, 9000) for _ in range(9)]
    memo = SessionHashes(BS)
    first = _request("t0", card + user1, reply1)
    memo.keep("s", first)
    cases = {
        "history grows": card + user1 + reply1 + [5, 6, 7, 8, 9, 10, 11],
        "history dropped": card + [7, 7, 7] + reply1,  # diverges inside the card's last block
        "other prefix": [1, 2, 3] + card,
    }
    for name, prompt in cases.items():
        new = Request(f"t1-{name}", prompt, SamplingParams(max_tokens=8), arrival_time=0.0)
        memo.prime("s", new)
        want = extend_block_hashes([], prompt, BS)
        assert new.block_hashes == want[: len(new.block_hashes)], name
        # strict=False: the new request keeps only the leading blocks it shares with the first one
        assert all(a is b for a, b in zip(new.block_hashes, first.block_hashes, strict=False)), name  # same objects
        shared = 0
        history = card + user1 + reply1
        while shared < len(prompt) // BS and prompt[: (shared + 1) * BS] == history[: (shared + 1) * BS]:
            shared += 1
        assert len(new.block_hashes) == min(shared, len(first.block_hashes)), name
    assert len(cases["history grows"]) // BS > len(first.block_hashes)  # the engine extends the rest itself


def test_unknown_sessions_and_salted_requests_get_nothing():
    memo = SessionHashes(BS, max_sessions=2)
    for i in range(3):
        memo.keep(f"s{i}", _request(f"r{i}", list(range(100 * i, 100 * i + 12))))
    fresh = Request("x", list(range(12)), SamplingParams(max_tokens=8), arrival_time=0.0)
    memo.prime("s0", fresh)  # s0 was dropped (oldest of three, two kept)
    assert fresh.block_hashes == []
    salted = Request("y", list(range(100, 112)), SamplingParams(max_tokens=8), arrival_time=0.0, cache_salt="k")
    memo.prime("s1", salted)
    assert salted.block_hashes == []
    plain = Request("z", list(range(100, 112)), SamplingParams(max_tokens=8), arrival_time=0.0)
    memo.prime("s1", plain)
    assert len(plain.block_hashes) == 2


def test_shared_blocks_agree_with_a_token_by_token_count_on_random_histories():
    """Random chats: the next prompt repeats the old one and grows, drops an old pair, keeps
    the reply without a header, or shares nothing; the primed blocks are exactly those a
    token-by-token comparison finds (oracle), capped by the old request's hashes."""
    rng = random.Random(7)
    for case in range(300):
        card = [rng.randrange(1000, 1100) for _ in range(rng.randrange(1, 40))]
        user = [rng.randrange(1000, 1100) for _ in range(rng.randrange(1, 12))]
        reply = [rng.randrange(1000, 1100) for _ in range(rng.randrange(1, 20))]
        old = _request(f"o{case}", card + user, reply)
        kind = rng.choice(["header", "plain", "dropped", "other"])
        nxt = [rng.randrange(1000, 1100) for _ in range(rng.randrange(1, 10))]
        prompt = {"header": card + user + [1, 2, 3] + reply + nxt, "plain": card + user + reply + nxt,
                  "dropped": card + reply + nxt, "other": nxt + card}[kind]
        memo = SessionHashes(BS)
        memo.keep("s", old)
        new = Request(f"n{case}", prompt, SamplingParams(max_tokens=8), arrival_time=0.0)
        memo.prime("s", new)
        both = card + user + reply
        shared = 0
        while shared < len(prompt) // BS and prompt[: (shared + 1) * BS] == both[: (shared + 1) * BS]:
            shared += 1
        assert len(new.block_hashes) == min(shared, len(old.block_hashes)), (case, kind)
        assert new.block_hashes == extend_block_hashes([], prompt, BS)[: len(new.block_hashes)], (case, kind)


def test_a_first_turn_shares_its_cards_blocks_with_the_latest_chat_of_its_group():
    rng = random.Random(3)
    card = [rng.randrange(1000, 9000) for _ in range(23)]
    memo = SessionHashes(BS)
    other = _request("a-t0", card + [1, 2, 3, 4, 5], [6, 7, 8, 9])
    memo.keep("a", other, prefix_group="char-1")
    prompt = card + [11, 12, 13, 14, 15, 16]
    first = Request("b-t0", list(prompt), SamplingParams(max_tokens=8), arrival_time=0.0)
    memo.prime("b", first, prefix_group="char-1")
    assert len(first.block_hashes) == len(card) // BS  # the card's whole blocks, no more
    assert first.block_hashes == extend_block_hashes([], prompt, BS)[: len(card) // BS]
    # strict=False: the first turn holds only the card's blocks, the other chat has its history's too
    assert all(x is y for x, y in zip(first.block_hashes, other.block_hashes, strict=False))
    stranger = Request("c-t0", list(prompt), SamplingParams(max_tokens=8), arrival_time=0.0)
    memo.prime("c", stranger, prefix_group="char-2")  # another character: nothing to share
    assert stranger.block_hashes == []
    memo.keep("b", _request("b-t0x", prompt, [21, 22, 23]), prefix_group="char-1")
    later = Request("b-t1", prompt + [21, 22, 23, 9, 9, 9, 9], SamplingParams(max_tokens=8), arrival_time=0.0)
    memo.prime("b", later, prefix_group="char-1")  # its own session first: more than the card
    assert len(later.block_hashes) > len(card) // BS
