from chatfleet.engine.block_hash import extend_block_hashes, hash_block
from chatfleet.engine.kv.block_pool import BlockPool
from chatfleet.engine.kv.prefix_cache import PrefixCache

BS = 4


def _cache_tokens(cache: PrefixCache, tokens, salt=None):
    hashes = extend_block_hashes([], tokens, BS, salt)
    blocks = cache.pool.allocate(len(hashes))
    cache.cache_blocks(blocks, hashes, 0, len(hashes))
    return blocks


def test_hashes_cover_only_full_blocks_and_chain():
    hashes = extend_block_hashes([], list(range(10)), BS)
    assert len(hashes) == 2
    assert hashes[1].parent_value == hashes[0].value
    # Same block tokens under a different parent hash differently.
    other = extend_block_hashes([], [9, 9, 9, 9] + list(range(4, 8)), BS)
    assert other[1].token_ids == hashes[1].token_ids and other[1].value != hashes[1].value
    # Incremental extension equals hashing at once.
    inc = extend_block_hashes([], list(range(5)), BS)
    extend_block_hashes(inc, list(range(12)), BS)
    assert inc == extend_block_hashes([], list(range(12)), BS)


def test_match_longest_prefix_in_whole_blocks():
    cache = PrefixCache(BlockPool(16), BS)
    blocks = _cache_tokens(cache, list(range(12)))
    m = cache.match(list(range(8)) + [99, 99, 99, 99, 5])
    assert m.device_tokens == 8 and m.host_tokens == 0 and m.blocks == blocks[:2]
    assert cache.match(list(range(3))).device_tokens == 0
    assert cache.match([1] + list(range(1, 12))).device_tokens == 0


def test_salt_isolates_tenants():
    cache = PrefixCache(BlockPool(16), BS)
    _cache_tokens(cache, list(range(8)), salt="alice")
    assert cache.match(list(range(8)), salt="alice").device_tokens == 8
    assert cache.match(list(range(8)), salt="bob").device_tokens == 0
    assert cache.match(list(range(8))).device_tokens == 0


def test_disabled_cache_never_matches_nor_registers():
    cache = PrefixCache(BlockPool(16), BS, enabled=False)
    _cache_tokens(cache, list(range(8)))
    assert cache.pool.num_cached_blocks == 0
    assert cache.match(list(range(8))).device_tokens == 0


def test_evicted_block_breaks_the_chain():
    pool = BlockPool(3)
    cache = PrefixCache(pool, BS)
    blocks = _cache_tokens(cache, list(range(12)))
    pool.free(blocks[::-1])
    pool.allocate(1)  # evicts the tail block
    assert cache.match(list(range(12))).device_tokens == 8
    assert hash_block(None, range(4)) == extend_block_hashes([], list(range(4)), BS)[0]
