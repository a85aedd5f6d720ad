"""KV blocks: one slot of a pool, named by its content hash (``engine/block_hash.py``).

A ``KVBlock`` is one slot of a pool (device or host). Besides its reference count and hash it
keeps a short usage history that eviction policies read as their hint (``BlockHint``).
"""

from __future__ import annotations

from dataclasses import dataclass

from chatfleet.engine.block_hash import BlockHash


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
