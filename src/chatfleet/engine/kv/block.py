"""KV blocks and their content hashes.

A full block's identity is a ``BlockHash``: a keyed BLAKE2b digest chained over the parent
block's digest, the block's own token ids and extra keys (a tenant's cache salt on the first
block reaches every later block through the chain). Digests are stable across processes and
machines of one byte order (unlike Python's ``hash()``, which is salted per process), so a
host tier, another replica or a log can name a block by its hash. A request's hashes are
computed once and extended as the request grows (``extend_block_hashes``).

A ``KVBlock`` is one slot of a pool (device or host). Besides its reference count and hash it
keeps a short usage history that eviction policies read as their hint (``BlockHint``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
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


@dataclass(frozen=True)
class BlockHint:
    """What an eviction policy knows about a block when it becomes evictable.

    ``session_id``: the conversation that last released it (None when the client sent none);
    ``last_use``: the injected clock's time of that release; ``num_uses``: requests that have
    held it; ``num_sessions``: changes of the holding session over its life (a card shared by
    many conversations counts many, a conversation's own tail counts 1).
    """

    session_id: str | None
    last_use: float
    num_uses: int
    num_sessions: int

    @property
    def is_shared(self) -> bool:
        return self.num_sessions > 1


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block slot of a pool; ``block_id`` indexes the pool's tensors."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # usage history (the eviction hint), written by the pool: reset when the block takes new
    # contents (allocate), one use more per reference a request takes (touch)
    session_id: str | None = None
    last_use: float = 0.0
    num_uses: int = 0
    num_sessions: int = 0

    def copy_history(self, other: KVBlock) -> None:
        """Take ``other``'s usage history (a block demoted or promoted between pools)."""
        self.session_id = other.session_id
        self.last_use = other.last_use
        self.num_uses = other.num_uses
        self.num_sessions = other.num_sessions

    def hint(self) -> BlockHint:
        return BlockHint(self.session_id, self.last_use, self.num_uses, self.num_sessions)

    def __repr__(self) -> str:  # short, for assertion messages
        h = None if self.block_hash is None else f"{self.block_hash.value:032x}"[:12]
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"
