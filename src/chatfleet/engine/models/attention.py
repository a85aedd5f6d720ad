"""Paged attention over a block-structured KV cache.

Each layer owns one ``KVCache``: ``key`` and ``value`` tensors of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``. A token at position ``p`` of a request
lives in slot ``block_table[p // block_size] * block_size + p % block_size``.

The runner orders a step's tokens as: single-token queries first (decodes, one per sequence),
then multi-token chunks (prefill). Decodes run as one padded gather plus one SDPA call; each
multi-token chunk runs one SDPA call over its sequence's cached keys with a causal offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class KVCache:
    """One layer's paged cache; ``key``/``value``: [num_blocks, block_size, num_kv_heads, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class ChunkSpan:
    """A multi-token query chunk of one sequence inside the step's flat token batch."""

    query_start: int  # index of its first token in the batch
    query_len: int
    start_position: int  # tokens of this sequence already in the cache before this step
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long; unused when start_position == 0
    causal_mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal (no prefix)

    @property
    def context_len(self) -> int:
        return self.start_position + self.query_len


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each query attends to (shared by layers)."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] long: cache slot of every new token
    num_decodes: int = 0  # tokens [0, num_decodes) are single-token queries, one sequence each
    decode_block_ids: torch.Tensor | None = None  # [num_decodes * max_blocks] long, row-major, padded
    decode_max_blocks: int = 0
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    chunks: list[ChunkSpan] = field(default_factory=list)


def build_attention_metadata(
    block_size: int,
    decode_context_lens: list[int],
    decode_block_tables: list[list[int]],
    chunk_starts: list[int],
    chunk_lens: list[int],
    chunk_block_tables: list[list[int]],
    device: torch.device | str,
) -> AttentionMetadata:
    """Metadata for ``len(decode_context_lens)`` single-token queries followed by the chunks.

    ``decode_context_lens[i]`` counts the decode's own new token; block tables may be longer
    than needed (only the blocks covering the context are used).
    """
    slots: list[int] = []
    num_decodes = len(decode_context_lens)
    decode_block_ids = decode_mask = None
    max_blocks = 0
    if num_decodes:
        for ctx, table in zip(decode_context_lens, decode_block_tables):
            pos = ctx - 1
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = (max(decode_context_lens) + block_size - 1) // block_size
        flat: list[int] = []
        for ctx, table in zip(decode_context_lens, decode_block_tables):
            n = (ctx + block_size - 1) // block_size
            flat.extend(table[:n])
            flat.extend([0] * (max_blocks - n))  # padding: any valid block, masked out below
        decode_block_ids = torch.tensor(flat, dtype=torch.long, device=device)
        lens = torch.tensor(decode_context_lens, dtype=torch.long, device=device)
        span = torch.arange(max_blocks * block_size, device=device)
        decode_mask = (span[None, :] < lens[:, None])[:, None, None, :]

    chunks: list[ChunkSpan] = []
    query_start = num_decodes
    for start, n, table in zip(chunk_starts, chunk_lens, chunk_block_tables):
        ctx = start + n
        nblocks = (ctx + block_size - 1) // block_size
        block_ids = torch.tensor(table[:nblocks], dtype=torch.long, device=device)
        pos = torch.arange(start, ctx, device=device)
        slots_t = block_ids[pos // block_size] * block_size + pos % block_size
        slots.extend(slots_t.tolist())
        mask = None
        if start > 0:
            mask = torch.arange(ctx, device=device)[None, :] <= pos[:, None]
        chunks.append(ChunkSpan(query_start, n, start, block_ids, mask))
        query_start += n

    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_block_ids=decode_block_ids,
        decode_max_blocks=max_blocks,
        decode_mask=decode_mask,
        chunks=chunks,
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain causal attention of one sequence. q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        is_causal=True, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write the step's new k/v into the cache, then attend. q: [T, Hq, D]; k, v: [T, Hkv, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.key.shape
    flat_k = cache.key.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = cache.value.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)

    out = torch.empty_like(q)
    d = meta.num_decodes
    if d:
        span = meta.decode_max_blocks * block_size
        kd = cache.key.index_select(0, meta.decode_block_ids).view(d, span, num_kv_heads, head_dim)
        vd = cache.value.index_select(0, meta.decode_block_ids).view(d, span, num_kv_heads, head_dim)
        od = F.scaled_dot_product_attention(
            q[:d].unsqueeze(2),  # [d, Hq, 1, D]
            kd.transpose(1, 2), vd.transpose(1, 2),  # [d, Hkv, span, D]
            attn_mask=meta.decode_mask, scale=scale, enable_gqa=True,
        )
        out[:d] = od.squeeze(2)
    for c in meta.chunks:
        qs = slice(c.query_start, c.query_start + c.query_len)
        if c.start_position == 0:  # nothing cached before: attend over the chunk itself
            out[qs] = causal_attention(q[qs], k[qs], v[qs], scale)
            continue
        ctx = c.context_len
        kc = cache.key.index_select(0, c.block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
        vc = cache.value.index_select(0, c.block_ids).view(-1, num_kv_heads, head_dim)[:ctx]
        oc = F.scaled_dot_product_attention(
            q[qs].transpose(0, 1), kc.transpose(0, 1), vc.transpose(0, 1),
            attn_mask=c.causal_mask, scale=scale, enable_gqa=True,
        )
        out[qs] = oc.transpose(0, 1)
    return out
