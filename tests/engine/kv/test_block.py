"""Block hashes: chained, keyed BLAKE2b, stable across processes; block usage history."""

import subprocess
import sys

import pytest

from chatfleet.engine.block_hash import extend_block_hashes, hash_block
from chatfleet.engine.kv.block_pool import BlockPool

BS = 4


def test_hash_is_stable_across_processes():
    code = (
        "from chatfleet.engine.block_hash import extend_block_hashes;"
        "print([h.value for h in extend_block_hashes([], list(range(12)), 4, 'salt')])"
    )
    env_hashseeds = []
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={"PYTHONHASHSEED": seed, "PYTHONPATH": ":".join(sys.path)})
        env_hashseeds.append(out.stdout.strip())
    here = str([h.value for h in extend_block_hashes([], list(range(12)), BS, "salt")])
    assert env_hashseeds == [here, here]


def test_chain_salt_and_tokens_all_change_the_hash():
    base = extend_block_hashes([], list(range(8)), BS)
    assert base[1].parent_value == base[0].value
    assert extend_block_hashes([], list(range(8)), BS, "t")[1].value != base[1].value  # salt chains on
    assert hash_block(None, [0, 1, 2, 4]).value != base[0].value
    assert hash_block(base[0], [4, 5, 6, 7]) == base[1]
    # token ids that would collide under a naive byte encoding stay distinct
    assert hash_block(None, [256]).value != hash_block(None, [0, 1]).value


def test_extension_hashes_only_new_blocks():
    hashes = extend_block_hashes([], list(range(6)), BS)
    first = hashes[0]
    extend_block_hashes(hashes, list(range(13)), BS)
    assert hashes[0] is first and len(hashes) == 3


def test_block_history_counts_uses_and_session_changes():
    """The pool writes a block's history: new contents start it, each prefix hit adds a use."""
    pool = BlockPool(1)
    (b,) = pool.allocate(1, "a")
    assert (b.num_uses, b.num_sessions, b.session_id) == (1, 1, "a")
    pool.cache_block(b, extend_block_hashes([], list(range(BS)), BS)[0])
    pool.free([b])
    pool.touch([b], "a")
    assert (b.num_uses, b.num_sessions) == (2, 1) and not b.hint().is_shared
    pool.touch([b], "b")
    assert b.hint().is_shared and b.hint().session_id == "b"
    pool.free([b])
    pool.free([b])
    (again,) = pool.allocate(1, None)  # evicts it: new contents, a new history
    assert again is b and (b.num_uses, b.num_sessions, b.session_id, b.block_hash) == (1, 1, None, None)


def test_extending_from_a_later_block_gives_the_same_chain():
    tokens = list(range(100, 140))
    whole = extend_block_hashes([], tokens, BS, "salt")
    part = extend_block_hashes([], tokens[:9], BS, "salt")  # two blocks (the ninth token waits)
    extend_block_hashes(part, tokens[2 * BS :], BS, "salt", first_block=2)  # only the rest passed
    assert part == whole
    with pytest.raises(ValueError):
        extend_block_hashes([], tokens[BS:], BS, first_block=1)  # would skip block 0
