import pytest

from chatfleet.engine.block_hash import hash_block
from chatfleet.engine.kv.block_pool import BlockPool, KVIntegrityError
from chatfleet.engine.kv.eviction_policies import make_eviction_policy
from chatfleet.errors import ConfigError


def test_allocate_and_free_counts():
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    assert pool.usage == pytest.approx(3 / 8)
    pool.check_integrity()
    pool.free(blocks[::-1])
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 8
    pool.check_integrity()


def test_over_allocation_and_double_free_are_errors():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    with pytest.raises(KVIntegrityError):
        pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(KVIntegrityError):
        pool.free(blocks[:1])


def test_cached_blocks_stay_findable_until_evicted_lru_tail_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = []
    parent = None
    for i, b in enumerate(blocks):
        parent = hash_block(parent, [i, i, i])
        hashes.append(parent)
        assert pool.cache_block(b, parent)
    pool.free(blocks[::-1])  # tail first
    pool.check_integrity()
    assert pool.num_cached_blocks == 4 and pool.num_free_blocks == 4
    assert all(pool.lookup(h) is b for h, b in zip(hashes, blocks, strict=True))
    # Needing one block evicts the tail (released first), not the head.
    (got,) = pool.allocate(1)
    assert got is blocks[3]
    assert pool.lookup(hashes[3]) is None and pool.lookup(hashes[0]) is blocks[0]
    assert pool.num_evictions == 1
    pool.check_integrity()


def test_unhashed_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, hash_block(None, [1]))
    pool.free([a, b, c])
    got = pool.allocate(2)
    assert a not in got
    assert pool.lookup(hash_block(None, [1])) is a


def test_touch_revives_cached_block_and_shares_it():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    h = hash_block(None, [7, 8])
    pool.cache_block(a, h)
    pool.free([a])
    assert pool.num_used_blocks == 0
    pool.touch([a])
    pool.touch([a])
    assert a.ref_cnt == 2 and pool.num_used_blocks == 1
    pool.check_integrity()
    pool.free([a])
    pool.free([a])
    pool.check_integrity()


def test_duplicate_hash_is_not_registered_twice():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    h = hash_block(None, [1, 2])
    assert pool.cache_block(a, h)
    assert not pool.cache_block(b, h)
    assert b.block_hash is None
    pool.check_integrity()


def test_lookup_rechecks_contents_on_hash_collision():
    pool = BlockPool(1)
    (a,) = pool.allocate(1)
    h = hash_block(None, [1, 2])
    pool.cache_block(a, h)
    forged = type(h)(h.value, None, (9, 9), ())
    assert pool.lookup(forged) is None
    assert pool.lookup(h) is a


def test_reset_prefix_cache_drops_unreferenced_and_reports_in_use():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, hash_block(None, [1]))
    pool.cache_block(b, hash_block(None, [2]))
    pool.free([a])
    assert pool.reset_prefix_cache() is False  # b is hashed and still in use
    assert pool.num_cached_blocks == 1 and a.block_hash is None
    pool.free([b, c])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0
    pool.check_integrity()


def test_integrity_check_catches_corruption():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    a.ref_cnt = 0
    with pytest.raises(KVIntegrityError):
        pool.check_integrity()


def test_unknown_eviction_policy_lists_valid_ones():
    with pytest.raises(ConfigError, match="lru"):
        make_eviction_policy("mru-ish")


def test_evictions_are_reported_before_reuse():
    seen = []
    pool = BlockPool(2, on_evict=seen.append)
    a, b = pool.allocate(2)
    ha, hb = hash_block(None, [1]), hash_block(None, [2])
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free([b, a])  # b released first: evicted first under LRU
    (got,) = pool.allocate(1)
    assert got is b and [(e.block_id, e.block_hash) for e in seen] == [(b.block_id, hb)]
    assert pool.lookup(hb) is None and pool.num_evictions == 1
    pool.check_integrity()


def test_free_stamps_last_use_from_the_injected_clock():
    now = [5.0]
    pool = BlockPool(1, clock=lambda: now[0])
    (a,) = pool.allocate(1, "s1")
    now[0] = 9.0
    pool.free([a])
    assert a.last_use == 9.0 and a.session_id == "s1"
