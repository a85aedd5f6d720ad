"""Paged attention over a block-structured KV cache.

Each layer owns one ``KVCache`` (``kv_cache.py``): ``key`` and ``value`` tensors of shape
``[num_kv_heads, num_blocks, block_size, head_dim]``, in the model's dtype or FP8 with a K and a
V scale (written quantized, read dequantized). A token at position ``p`` of a request
lives in slot ``block_table[p // block_size] * block_size + p % block_size`` of every head.
Heads come first so that gathering a batch's blocks yields ``[num_kv_heads * batch, tokens,
head_dim]`` directly, ready for batched matmuls without another copy.

The runner orders a step's tokens as: single-token queries first (decodes, one per sequence,
shortest context first), then multi-token chunks (prefill). Decodes run in groups of similar
context length (``decode_attention.py``); each multi-token chunk runs ``chunk_attention`` over
its sequence's keys with a causal offset (``prefill_attention.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from chatfleet.engine.models.decode_attention import (
    DECODE_PAD_LIMIT,
    DecodeGroup,
    build_decode_groups,
    decode_attention,
)
from chatfleet.engine.models.kv_cache import KVCache, dequantize_fp8
from chatfleet.engine.models.paged_decode_cpu import gather_fp8, paged_decode
from chatfleet.engine.models.prefill_attention import chunk_attention
from chatfleet.engine.models.workspace import Workspace, gather_blocks

__all__ = ["AttentionMetadata", "ChunkSpan", "KVCache", "PagedAttentionOps", "Workspace",
           "build_attention_metadata", "causal_attention", "paged_attention"]


class PagedAttentionOps(Protocol):
    """A step's paged attention run by other kernels, over block tables the runner built once
    for the step (``engine/kernels/step_attention.py``: the KV store and the paged decode and
    prefill dispatchers). The model only calls it; it never imports the kernels."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, scale: float,
               write: bool) -> torch.Tensor:
        """As ``paged_attention``: store k/v (when ``write``), then q [T, Hq, D] -> [T, Hq, D]."""
        ...


@dataclass
class ChunkSpan:
    """A multi-token query chunk of one sequence inside the step's flat token batch."""

    query_start: int  # index of its first token in the batch
    query_len: int
    start_position: int  # tokens of this sequence already in the cache before this step
    block_ids: torch.Tensor  # blocks from key_start to the context end; unused when start_position == 0
    key_start: int = 0  # first position read from the cache (block-aligned; > 0 only in a window)

    @property
    def context_len(self) -> int:
        return self.start_position + self.query_len


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each query attends to (shared by layers)."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] long: cache slot of every new token
    num_decodes: int = 0  # tokens [0, num_decodes) are single-token queries, one sequence each
    decode_groups: list[DecodeGroup] = field(default_factory=list)  # cover [0, num_decodes) in order
    chunks: list[ChunkSpan] = field(default_factory=list)
    workspace: Workspace | None = None  # reusable gather buffers (saves page faults per layer)
    sliding_window: int | None = None  # queries see only the last ``sliding_window`` positions
    ops: PagedAttentionOps | None = None  # set: the step runs through these kernels instead
    # Set (instead of decode_groups): the decodes run the C++ kernel (paged_decode_cpu.py) over
    # these [num_decodes, max blocks] int64 tables (padded with block 0) and [num_decodes] lengths.
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None


def build_attention_metadata(
    block_size: int,
    decode_context_lens: list[int],
    decode_block_tables: list[list[int]],
    chunk_starts: list[int],
    chunk_lens: list[int],
    chunk_block_tables: list[list[int]],
    device: torch.device | str,
    decode_pad_limit: int = DECODE_PAD_LIMIT,
    sliding_window: int | None = None,
    decode_kernel: bool = False,
) -> AttentionMetadata:
    """Metadata for ``len(decode_context_lens)`` single-token queries followed by the chunks.

    ``decode_context_lens[i]`` counts the decode's own new token; block tables may be longer
    than needed (only the blocks covering the context are used). Decodes are grouped in the
    given order (see ``decode_attention.group_decodes``); sorted by length they pad least.
    With ``sliding_window``, only blocks holding positions inside some query's window are read.
    ``decode_kernel``: the decodes run the C++ kernel (block tables as one tensor, no groups);
    the caller checks it applies (``paged_decode_cpu.available`` and ``supports``, no window).
    """
    slots: list[torch.Tensor] = []
    num_decodes = len(decode_context_lens)
    decode_groups: list[DecodeGroup] = []
    decode_tables = decode_lens = None
    if num_decodes:
        decode_slots = [table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
                        for ctx, table in zip(decode_context_lens, decode_block_tables, strict=True)]
        slots.append(torch.tensor(decode_slots, dtype=torch.long, device=device))
    if num_decodes and decode_kernel:
        assert sliding_window is None, "the decode kernel has no sliding window"
        width = max(-(-ctx // block_size) for ctx in decode_context_lens)
        rows = [table[:width] + [0] * (width - min(len(table), width)) for table in decode_block_tables]
        decode_tables = torch.tensor(rows, dtype=torch.long, device=device)
        decode_lens = torch.tensor(decode_context_lens, dtype=torch.long, device=device)
    elif num_decodes:
        decode_groups = build_decode_groups(decode_context_lens, decode_block_tables, block_size, device,
                                            decode_pad_limit, sliding_window)

    chunks: list[ChunkSpan] = []
    query_start = num_decodes
    for start, n, table in zip(chunk_starts, chunk_lens, chunk_block_tables, strict=True):
        ctx = start + n
        nblocks = (ctx + block_size - 1) // block_size
        first = 0 if sliding_window is None else max(0, start - sliding_window + 1) // block_size
        block_ids = torch.tensor(table[first:nblocks], dtype=torch.long, device=device)
        pos = torch.arange(start, ctx, device=device)
        slots.append(block_ids[pos // block_size - first] * block_size + pos % block_size)
        chunks.append(ChunkSpan(query_start, n, start, block_ids, first * block_size))
        query_start += n

    return AttentionMetadata(
        block_size=block_size,
        slot_mapping=torch.cat(slots) if slots else torch.empty(0, dtype=torch.long, device=device),
        num_decodes=num_decodes,
        decode_groups=decode_groups,
        chunks=chunks,
        sliding_window=sliding_window,
        decode_block_tables=decode_tables,
        decode_context_lens=decode_lens,
    )


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     kernels: str = "torch", window: int | None = None) -> torch.Tensor:
    """Plain causal attention of one sequence. q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]."""
    return chunk_attention(q, k.transpose(0, 1), v.transpose(0, 1), 0, scale, kernels, window)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                    meta: AttentionMetadata, scale: float, kernels: str = "torch",
                    write: bool = True) -> torch.Tensor:
    """Write the step's new k/v into the cache, then attend. q: [T, Hq, D]; k, v: [T, Hkv, D].

    ``kernels``: the resolved kernel backend for multi-token chunks (``onednn`` or ``torch``).
    ``write=False``: k/v are already in ``cache`` (a layer reading another layer's KV).
    """
    if meta.ops is not None:
        return meta.ops.attend(q, k, v, cache, scale, write)
    num_kv_heads, num_blocks, block_size, head_dim = cache.key.shape
    if write:
        cache.write(meta.slot_mapping, k, v)

    d = meta.num_decodes
    ks, vs = (cache.k_scale, cache.v_scale) if cache.is_fp8 else (1.0, 1.0)
    if not meta.chunks:
        return _decodes(q, cache, meta, scale, ks, vs)
    out = torch.empty_like(q)
    if d:
        out[:d] = _decodes(q[:d], cache, meta, scale, ks, vs)
    for c in meta.chunks:
        qs = slice(c.query_start, c.query_start + c.query_len)
        if c.start_position == 0:  # nothing cached before: attend over the chunk itself
            kq, vq = cache.round_trip(k[qs], v[qs])
            kc, vc = kq.transpose(0, 1), vq.transpose(0, 1)
        else:  # the whole context from the cache: [Hkv, blocks * block_size, D], first ctx rows
            ctx = c.context_len - c.key_start
            kc = _read(cache.key, c.block_ids, meta.workspace, "ck", ks, q.dtype)
            vc = _read(cache.value, c.block_ids, meta.workspace, "cv", vs, q.dtype)
            kc = kc.view(num_kv_heads, -1, head_dim)[:, :ctx]
            vc = vc.view(num_kv_heads, -1, head_dim)[:, :ctx]
        out[qs] = chunk_attention(q[qs], kc, vc, c.start_position, scale, kernels, meta.sliding_window,
                                  c.key_start if c.start_position else 0)
    return out


def _decodes(q: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float, ks: float,
             vs: float) -> torch.Tensor:
    """The step's single-token queries: the C++ kernel where the metadata has its tables, else torch ops."""
    if meta.decode_block_tables is not None:
        assert meta.decode_context_lens is not None
        return paged_decode(q, cache.key, cache.value, meta.decode_block_tables, meta.decode_context_lens, scale,
                            k_scale=ks, v_scale=vs)
    return decode_attention(q, cache.key, cache.value, meta.decode_groups, meta.workspace, scale, ks, vs)


def _read(cache: torch.Tensor, block_ids: torch.Tensor, workspace: Workspace | None, name: str, scale: float,
          dtype: torch.dtype) -> torch.Tensor:
    """The blocks of one cache tensor, dequantized to ``dtype`` when the cache is FP8 (in one C++
    pass where the kernel is built)."""
    if cache.dtype != dtype:
        shape = (cache.shape[0], block_ids.shape[0], *cache.shape[2:])
        out = workspace.get(name + "_dq", shape, dtype, cache.device) if workspace is not None else None
        widened = gather_fp8(cache, block_ids, scale, dtype, out)
        if widened is not None:
            return widened
    raw = gather_blocks(cache, block_ids, workspace, name)
    if raw.dtype == dtype:
        return raw
    out = workspace.get(name + "_dq", tuple(raw.shape), dtype, raw.device) if workspace is not None else None
    return dequantize_fp8(raw, scale, dtype, out)
