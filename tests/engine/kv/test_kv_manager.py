"""PagedKVManager (the single-pool KV manager) unit tests and a randomized workload with a content oracle.

The oracle keeps what each physical block would hold (token id per slot) and checks that every
prefix-cache hit hands a request blocks whose contents are exactly its own tokens.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatfleet.engine.kv.manager import PagedKVManager
from chatfleet.engine.kv.prefix_cache import MatchResult
from chatfleet.engine.request import Request, SamplingParams
from chatfleet.errors import KVIntegrityError

BS = 4


def _req(rid, tokens, **kw):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, **{k: v for k, v in kw.items() if k != "salt"}),
                   cache_salt=kw.get("salt"))


def _compute(kv: PagedKVManager, req: Request, n: int, prefix: MatchResult | None = None):
    got = kv.allocate(req, n, prefix=prefix)
    if got is None:
        return None
    if prefix is not None:
        req.num_computed_tokens = prefix.device_tokens
    req.num_computed_tokens += n
    kv.cache_computed(req)
    return got


def test_allocate_grows_block_table_as_tokens_grow():
    kv = PagedKVManager(8, BS)
    r = _req("a", range(6))
    got = _compute(kv, r, 6, kv.match_prefix(r))
    assert got.num_new_blocks == 2 and kv.num_blocks_of("a") == 2
    r.output_token_ids.append(100)
    r.output_token_ids.append(101)
    assert _compute(kv, r, 1).block_ids == []  # position 6 fits the second block
    r.output_token_ids.append(102)
    assert _compute(kv, r, 1).block_ids == []  # position 7 too
    r.output_token_ids.append(103)
    assert len(_compute(kv, r, 1).block_ids) == 1  # position 8 opens a third block
    kv.check_integrity()
    kv.free("a")
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 0


def test_prefix_hit_shares_blocks_and_leaves_last_token():
    kv = PagedKVManager(16, BS)
    a = _req("a", range(8))
    _compute(kv, a, 8, kv.match_prefix(a))
    b = _req("b", range(8))
    m = kv.match_prefix(b)
    assert m.device_tokens == 4  # the whole prompt may not match: the last token is computed
    got = _compute(kv, b, 4, m)
    assert got.num_hit_blocks == 1
    assert kv.block_ids("b")[0] == kv.block_ids("a")[0]
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_cnt == 2
    assert kv.prefix_cache.queries == 16 and kv.prefix_cache.hits == 4
    kv.check_integrity()


def test_prompt_logprobs_and_disabled_cache_skip_reuse():
    kv = PagedKVManager(16, BS)
    a = _req("a", range(9))
    _compute(kv, a, 9, kv.match_prefix(a))
    assert kv.match_prefix(_req("b", range(9), prompt_logprobs=1)).device_tokens == 0
    off = PagedKVManager(16, BS, enable_prefix_caching=False)
    a2 = _req("a", range(9))
    _compute(off, a2, 9, off.match_prefix(a2))
    assert off.match_prefix(_req("b", range(9))).device_tokens == 0
    assert off.pool.num_cached_blocks == 0


def test_allocate_returns_none_when_full_and_changes_nothing():
    kv = PagedKVManager(2, BS)
    a = _req("a", range(8))
    assert _compute(kv, a, 8, kv.match_prefix(a)) is not None
    b = _req("b", range(50, 54))
    assert kv.allocate(b, 4, prefix=kv.match_prefix(b)) is None
    assert not kv.has_blocks("b")
    kv.check_integrity()


def test_reset_prefix_cache():
    kv = PagedKVManager(8, BS)
    a = _req("a", range(8))
    _compute(kv, a, 8, kv.match_prefix(a))
    assert kv.reset_prefix_cache() is False
    kv.free("a")
    assert kv.reset_prefix_cache() is True
    assert kv.match_prefix(_req("b", range(9))).device_tokens == 0


# ---- randomized workload -----------------------------------------------------------------------

PREFIXES = [[1] * 9, [1] * 5 + [2] * 7, [3, 4] * 6, []]

ops = st.lists(
    st.tuples(st.sampled_from(["new", "new", "step", "step", "step", "step", "free", "reset"]),
              st.integers(0, 3), st.integers(0, 11), st.sampled_from([None, None, "s"])),
    min_size=20, max_size=80,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, num_blocks=st.integers(1, 16))
def test_randomized_workload_keeps_integrity_and_contents(ops, num_blocks):
    kv = PagedKVManager(num_blocks, BS)
    contents: dict[int, list] = {}  # block id -> token per slot (None: never written)
    live: dict[str, Request] = {}
    counter = 0

    def write(req: Request, start: int, end: int):
        table = kv.block_ids(req.request_id)
        assert len(table) * BS >= end
        tokens = req.all_token_ids
        for pos in range(start, end):
            contents.setdefault(table[pos // BS], [None] * BS)[pos % BS] = tokens[pos]

    def check_contents(req: Request, upto: int):
        table = kv.block_ids(req.request_id)
        tokens = req.all_token_ids
        for pos in range(upto):
            assert contents[table[pos // BS]][pos % BS] == tokens[pos], "prefix hit with wrong KV"

    for kind, pick, size, salt in ops:
        if kind == "new":
            counter += 1
            rid = f"r{counter}"
            live[rid] = Request(rid, PREFIXES[pick] + [10 + counter] * (size + 1),
                                SamplingParams(max_tokens=4), cache_salt=salt)
        elif kind == "step" and live:
            req = list(live.values())[pick % len(live)]
            if req.num_computed_tokens == req.num_tokens:
                req.output_token_ids.append(20 + size)  # a sampled token, not computed yet
            prefix = None
            if not kv.has_blocks(req.request_id):
                prefix = kv.match_prefix(req)
            start = prefix.device_tokens if prefix else req.num_computed_tokens
            n = min(size + 1, req.num_tokens - start)
            if _compute(kv, req, n, prefix) is not None:
                if prefix:
                    check_contents(req, prefix.device_tokens)
                write(req, req.num_computed_tokens - n, req.num_computed_tokens)
                check_contents(req, req.num_computed_tokens)
        elif kind == "free" and live:
            rid = list(live)[pick % len(live)]
            req = live.pop(rid)
            kv.free(rid)
            if size % 2:  # preempted rather than finished: recomputes later from scratch
                req.num_computed_tokens = 0
                live[rid] = req
        elif kind == "reset":
            kv.reset_prefix_cache()
        kv.check_integrity()
        usage = kv.usage
        assert 0.0 <= usage <= 1.0
    for rid in list(live):
        kv.free(rid)
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 0
    assert kv.pool.num_free_blocks == num_blocks
    assert kv.prefix_cache.hits <= kv.prefix_cache.queries


def test_free_unknown_request_is_noop():
    kv = PagedKVManager(2, BS)
    kv.free("nope")
    kv.check_integrity()
    with pytest.raises(KVIntegrityError, match="not in use"):
        kv.pool.free([kv.pool.blocks[0]])


def test_a_waiting_request_is_hashed_once_not_every_step(monkeypatch):
    from chatfleet.engine import block_hash as block

    calls = []
    real = block.hash_block
    monkeypatch.setattr(block, "hash_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    kv = PagedKVManager(16, BS)
    r = _req("a", range(41))
    for _ in range(5):  # a request waiting for memory is matched every step
        kv.match_prefix(r)
    assert len(calls) == 10  # its 10 full blocks, once
    _compute(kv, r, 41, kv.match_prefix(r))
    r.output_token_ids += [7, 8, 9, 10]
    _compute(kv, r, 4)  # 45 tokens computed: an 11th full block
    kv.match_prefix(r)
    assert len(calls) == 11  # one more block, hashed once
