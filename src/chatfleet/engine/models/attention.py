"""Paged attention over a block-structured KV cache.

Each layer owns one ``KVCache``: ``key`` and ``value`` tensors of shape
``[num_kv_heads, num_blocks, block_size, head_dim]``. A token at position ``p`` of a request
lives in slot ``block_table[p // block_size] * block_size + p % block_size`` of every head.
Heads come first so that gathering a batch's blocks yields ``[num_kv_heads * batch, tokens,
head_dim]`` directly, ready for batched matmuls without another copy.

The runner orders a step's tokens as: single-token queries first (decodes, one per sequence),
then multi-token chunks (prefill). Decodes run as one padded gather of keys, one batched matmul
for the scores and, on CPU, ``embedding_bag`` weighted sums of the value rows in place (no copy);
each multi-token chunk runs ``chunk_attention`` over its sequence's keys with a causal offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from chatfleet.engine.models.prefill_attention import chunk_attention


@dataclass
class KVCache:
    """One layer's paged cache; ``key``/``value``: [num_kv_heads, num_blocks, block_size, head_dim]."""

    key: torch.Tensor
    value: torch.Tensor

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> KVCache:
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


class Workspace:
    """Grow-only scratch memory for gathered keys/values, reused by every layer and step."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * buf.numel() if buf is not None else 0), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)


@dataclass
class ChunkSpan:
    """A multi-token query chunk of one sequence inside the step's flat token batch."""

    query_start: int  # index of its first token in the batch
    query_len: int
    start_position: int  # tokens of this sequence already in the cache before this step
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long; unused when start_position == 0

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
    decode_mask: torch.Tensor | None = None  # [num_decodes, max_blocks * block_size] bool, True: attend
    chunks: list[ChunkSpan] = field(default_factory=list)
    workspace: Workspace | None = None  # reusable gather buffers (saves page faults per layer)
    _decode_bias: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _decode_bags: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def decode_bias(self, num_kv_heads: int) -> torch.Tensor:
        """Additive float32 mask [num_kv_heads * num_decodes, 1, span] (0 or -inf), built once per step."""
        bias = self._decode_bias.get(num_kv_heads)
        if bias is None:
            assert self.decode_mask is not None
            zeros = torch.zeros(self.decode_mask.shape, dtype=torch.float32, device=self.decode_mask.device)
            bias = zeros.masked_fill_(~self.decode_mask, float("-inf")).repeat(num_kv_heads, 1).unsqueeze(1)
            self._decode_bias[num_kv_heads] = bias
        return bias

    def decode_bags(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``embedding_bag`` indices and offsets for P @ V straight from one head's cache rows.

        One bag per (sequence, query head of a group): the cache slots of the sequence's padded
        span, ``[num_decodes * group * span]`` long, and the bag offsets ``[num_decodes * group]``.
        """
        bags = self._decode_bags.get(group)
        if bags is None:
            assert self.decode_block_ids is not None
            d, bs = self.num_decodes, self.block_size
            span = self.decode_max_blocks * bs
            ids = self.decode_block_ids.view(d, self.decode_max_blocks, 1) * bs
            slots = (ids + torch.arange(bs, device=ids.device)).view(d, 1, span)
            index = slots.expand(d, group, span).reshape(-1)
            offsets = torch.arange(0, d * group * span, span, device=ids.device)
            bags = self._decode_bags[group] = (index, offsets)
        return bags


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
    slots: list[torch.Tensor] = []
    num_decodes = len(decode_context_lens)
    decode_block_ids = decode_mask = None
    max_blocks = 0
    if num_decodes:
        decode_slots = [table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
                        for ctx, table in zip(decode_context_lens, decode_block_tables)]
        slots.append(torch.tensor(decode_slots, dtype=torch.long, device=device))
        max_blocks = (max(decode_context_lens) + block_size - 1) // block_size
        flat: list[int] = []
        for ctx, table in zip(decode_context_lens, decode_block_tables):
            n = (ctx + block_size - 1) // block_size
            flat.extend(table[:n])
            flat.extend([0] * (max_blocks - n))  # padding: any valid block, masked out below
        decode_block_ids = torch.tensor(flat, dtype=torch.long, device=device)
        lens = torch.tensor(decode_context_lens, dtype=torch.long, device=device)
        span = torch.arange(max_blocks * block_size, device=device)
        decode_mask = span[None, :] < lens[:, None]

    chunks: list[ChunkSpan] = []
    query_start = num_decodes
    for start, n, table in zip(chunk_starts, chunk_lens, chunk_block_tables):
        ctx = start + n
        nblocks = (ctx + block_size - 1) // block_size
        block_ids = torch.tensor(table[:nblocks], dtype=torch.long, device=device)
        pos = torch.arange(start, ctx, device=device)
        slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
        chunks.append(ChunkSpan(query_start, n, start, block_ids))
        query_start += n

    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.cat(slots) if slots else torch.empty(0, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_block_ids=decode_block_ids,
        decode_max_blocks=max_blocks,
        decode_mask=decode_mask,
        chunks=chunks,
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     kernels: str = "torch") -> torch.Tensor:
    """Plain causal attention of one sequence. q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]."""
    return chunk_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, scale, kernels)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, workspace: Workspace | None,
            name: str) -> torch.Tensor:
    """cache[:, block_ids] -> [Hkv, len(block_ids), block, D], into the workspace when given."""
    if workspace is None:
        return cache.index_select(1, block_ids)
    shape = (cache.shape[0], block_ids.numel(), cache.shape[2], cache.shape[3])
    out = workspace.get(name, shape, cache.dtype, cache.device)
    return torch.index_select(cache, 1, block_ids, out=out)


def _decode_attention(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Single-token queries q: [d, Hq, D], one per sequence -> [d, Hq, D]."""
    num_kv_heads, _, block_size, head_dim = cache.key.shape
    d, num_heads, _ = q.shape
    group = num_heads // num_kv_heads
    span = meta.decode_max_blocks * block_size
    assert meta.decode_block_ids is not None
    # [Hkv, d * max_blocks, block, D] -> [Hkv * d, span, D]: a view, no further copy.
    k = _gather(cache.key, meta.decode_block_ids, meta.workspace, "k").view(num_kv_heads * d, span, head_dim)
    # q heads h * group .. h * group + group - 1 share kv head h.
    qg = q.view(d, num_kv_heads, group, head_dim).transpose(0, 1).reshape(num_kv_heads * d, group, head_dim)
    bias = meta.decode_bias(num_kv_heads)
    if q.dtype == torch.float32:
        scores = torch.baddbmm(bias, qg, k.transpose(1, 2), alpha=scale)
    else:  # low-precision inputs: softmax in float32
        scores = torch.bmm(qg, k.transpose(1, 2)).float().mul_(scale).add_(bias)
    probs = scores.softmax(dim=-1).to(q.dtype)  # [Hkv * d, group, span]; padding gets weight 0
    if q.device.type == "cpu":
        # P @ V as weighted sums of cache rows (embedding_bag): reads V in place, no gathered copy.
        index, offsets = meta.decode_bags(group)
        out = torch.empty(d, num_kv_heads, group, head_dim, dtype=q.dtype, device=q.device)
        flat_v = cache.value.view(num_kv_heads, -1, head_dim)
        for h in range(num_kv_heads):
            weights = probs[h * d : (h + 1) * d].reshape(-1)
            out[:, h] = F.embedding_bag(index, flat_v[h], offsets, mode="sum",
                                        per_sample_weights=weights).view(d, group, head_dim)
        return out.view(d, num_heads, head_dim)
    v = _gather(cache.value, meta.decode_block_ids, meta.workspace, "v").view(num_kv_heads * d, span, head_dim)
    out = torch.bmm(probs, v)  # [Hkv * d, group, D]
    return out.view(num_kv_heads, d, group, head_dim).transpose(0, 1).reshape(d, num_heads, head_dim)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, kernels: str = "torch") -> torch.Tensor:
    """Write the step's new k/v into the cache, then attend. q: [T, Hq, D]; k, v: [T, Hkv, D].

    ``kernels``: the resolved kernel backend for multi-token chunks (``onednn`` or ``torch``).
    """
    num_kv_heads, num_blocks, block_size, head_dim = cache.key.shape
    flat_k = cache.key.view(num_kv_heads, num_blocks * block_size, head_dim)
    flat_v = cache.value.view(num_kv_heads, num_blocks * block_size, head_dim)
    flat_k.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
    flat_v.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

    d = meta.num_decodes
    if not meta.chunks:
        return _decode_attention(q, cache, meta, scale)
    out = torch.empty_like(q)
    if d:
        out[:d] = _decode_attention(q[:d], cache, meta, scale)
    for c in meta.chunks:
        qs = slice(c.query_start, c.query_start + c.query_len)
        if c.start_position == 0:  # nothing cached before: attend over the chunk itself
            kc, vc = k[qs].transpose(0, 1), v[qs].transpose(0, 1)
        else:  # the whole context from the cache: [Hkv, blocks * block_size, D], first ctx rows
            ctx = c.context_len
            kc = _gather(cache.key, c.block_ids, meta.workspace, "ck").view(num_kv_heads, -1, head_dim)[:, :ctx]
            vc = _gather(cache.value, c.block_ids, meta.workspace, "cv").view(num_kv_heads, -1, head_dim)[:, :ctx]
        out[qs] = chunk_attention(q[qs], kc, vc, c.start_position, scale, kernels)
    return out
