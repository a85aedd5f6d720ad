"""A block's content hash: a request's full blocks named by what they hold.

A full block's identity is a ``BlockHash``: a keyed BLAKE2b digest chained over the parent
block's digest, the block's own token ids and extra keys (a tenant's cache salt on the first
block reaches every later block through the chain). Digests are stable across processes and
machines of one byte order (unlike Python's ``hash()``, which is salted per process), so a
host tier, another replica or a log can name a block by its hash. A request's hashes are
computed once and extended as the request grows (``extend_block_hashes``); the KV layer
(``kv/``) indexes its cached blocks by them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

# Changing the key (or the encoding below) changes every block's identity: bump the version.
_HASH_KEY = b"chatfleet/kv-block/v1"
_DIGEST_SIZE = 16
_KEYED = hashlib.blake2b(key=_HASH_KEY, digest_size=_DIGEST_SIZE)


class BlockHash(NamedTuple):
    """Identity of a full block: its own tokens, its parent's hash and extra keys (e.g. a salt).

    ``value`` is the chained digest used as the index key; the other fields let a hit be
    re-checked exactly, so a digest collision can never serve another prefix's KV. An immutable
    tuple: built in C and compared in C (millions per simulated hour).
    """

    value: int
    parent_value: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...] = ()


_NO_PARENT = b"\x00" * _DIGEST_SIZE


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple[str, ...] = ()) -> BlockHash:
    """The chained keyed BLAKE2b hash of one full block."""
    parent_value = None if parent is None else parent.value
    tokens = tuple(token_ids)
    h = _KEYED.copy()  # the key's block already compressed
    h.update((_NO_PARENT if parent_value is None else parent_value.to_bytes(_DIGEST_SIZE, "little"))
             + len(tokens).to_bytes(4, "little") + array("q", tokens).tobytes())
    for key in extra_keys:
        data = key.encode("utf-8")
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return BlockHash(int.from_bytes(h.digest(), "little"), parent_value, tokens, extra_keys)


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, salt: str | None = None,
    *, first_block: int = 0,
) -> list[BlockHash]:
    """Append (in place) the hashes of the full blocks of ``token_ids`` not yet in ``hashes``.

    ``token_ids`` starts at position ``first_block * block_size`` (0 by default, at most
    ``len(hashes)`` blocks on); only blocks past ``len(hashes)`` are hashed, so a growing
    request pays for each block once.
    """
    if first_block > len(hashes):
        raise ValueError(f"tokens from block {first_block} cannot extend {len(hashes)} hashes")
    for i in range(len(hashes), first_block + len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra = (salt,) if (i == 0 and salt is not None) else ()
        j = i - first_block
        hashes.append(hash_block(parent, token_ids[j * block_size : (j + 1) * block_size], extra))
    return hashes
