"""A step's paged attention through the kernels: block tables built once per step, dispatched
per layer (the engine's path on a GPU; on the CPU the same path runs the references).

The runner orders a step's tokens as decodes first (one token each), then multi-token chunks
(``models/attention.py``). ``build_step_tables`` turns that plan into the tensors the kernels
take, once for every layer of the step: int32 block tables and context lengths for the decodes,
int32 block tables, query offsets and context lengths for the chunks, and the long slot of every
new token (``-1`` for a padding row, which the store skips). ``KernelAttention.attend`` is what
``paged_attention`` calls when the metadata carries it (``AttentionMetadata.ops``): store the
step's keys and values (``kv_store.store_kv``), then ``paged_decode_attention`` over the decodes
and ``paged_prefill_attention`` over the chunks, each with ``backend`` (``auto``: Triton on CUDA
tensors, the torch reference elsewhere).

The layering stays one way: ``models`` defines the ``PagedAttentionOps`` protocol and never
imports the kernels; the kernels import ``models`` (their references), and the runner builds
these tables and hands them to the model inside the metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from chatfleet.engine.kernels.attention_params import AttentionParams
from chatfleet.engine.kernels.kv_store import store_kv
from chatfleet.engine.kernels.paged_decode import paged_decode_attention
from chatfleet.engine.kernels.paged_prefill import paged_prefill_attention
from chatfleet.engine.models.attention import AttentionMetadata, KVCache


@dataclass
class StepTables:
    """One step's attention plan as tensors (see the module doc); shared by every layer."""

    block_size: int
    slot_mapping: torch.Tensor  # [T] long; -1: a padding row (never stored)
    num_decodes: int
    decode_tables: torch.Tensor | None  # [D, W] int32
    decode_lens: torch.Tensor | None  # [D] int32, counting each decode's new token
    chunk_tables: torch.Tensor | None  # [C, W] int32
    query_starts: torch.Tensor | None  # [C + 1] int32, offsets into the chunks' tokens
    chunk_lens: torch.Tensor | None  # [C] int32: each chunk's context length after the step
    max_query_len: int = 0


def _rows(tables: Sequence[Sequence[int]], needed: Sequence[int], width: int | None) -> list[list[int]]:
    """Each table cut to the blocks its context needs, padded with block 0 to one width."""
    w = max(max(needed, default=1), 1) if width is None else width
    out = []
    for table, n in zip(tables, needed, strict=True):
        row = [max(b, 0) for b in table[:n]]
        out.append(row + [0] * (w - len(row)))
    return out


def build_step_tables(block_size: int, decode_context_lens: Sequence[int],
                      decode_block_tables: Sequence[Sequence[int]], chunk_starts: Sequence[int],
                      chunk_lens: Sequence[int], chunk_block_tables: Sequence[Sequence[int]],
                      device: torch.device | str, table_width: int | None = None) -> StepTables:
    """The tensors for ``len(decode_context_lens)`` decodes followed by the chunks (one host to
    device copy per tensor). ``table_width``: every table row padded to this many blocks (a
    captured graph's fixed shape); else to the step's longest context."""
    slots: list[int] = []
    for ctx, table in zip(decode_context_lens, decode_block_tables, strict=True):
        slots.append(table[(ctx - 1) // block_size] * block_size + (ctx - 1) % block_size)
    for start, n, table in zip(chunk_starts, chunk_lens, chunk_block_tables, strict=True):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
    i32 = torch.int32

    def tensor(values: list[int] | list[list[int]], dtype: torch.dtype = i32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    dec_tables = dec_lens = ch_tables = starts = ch_lens = None
    if decode_context_lens:
        needed = [-(-ctx // block_size) for ctx in decode_context_lens]
        dec_tables = tensor(_rows(decode_block_tables, needed, table_width))
        dec_lens = tensor(list(decode_context_lens))
    max_query_len = 0
    if chunk_lens:
        ctxs = [s + n for s, n in zip(chunk_starts, chunk_lens, strict=True)]
        ch_tables = tensor(_rows(chunk_block_tables, [-(-c // block_size) for c in ctxs], table_width))
        offsets = [0]
        for n in chunk_lens:
            offsets.append(offsets[-1] + n)
        starts, ch_lens = tensor(offsets), tensor(ctxs)
        max_query_len = max(chunk_lens)
    return StepTables(block_size, tensor(slots, torch.long), len(decode_context_lens), dec_tables, dec_lens,
                      ch_tables, starts, ch_lens, max_query_len)


@dataclass
class KernelAttention:
    """``PagedAttentionOps`` over one step's ``StepTables`` for the layers of one window."""

    tables: StepTables
    window: int | None = None
    backend: str = "auto"  # kernels/backend.py: auto, torch or triton

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, scale: float,
               write: bool) -> torch.Tensor:
        t = self.tables
        if write:
            store_kv(k, v, cache.key, cache.value, t.slot_mapping, cache.k_scale, cache.v_scale, self.backend)
        ks, vs = (cache.k_scale, cache.v_scale) if cache.is_fp8 else (1.0, 1.0)
        params = AttentionParams(scale, self.window, None, ks, vs)
        d = t.num_decodes
        parts = []
        if d:
            assert t.decode_tables is not None and t.decode_lens is not None
            parts.append(paged_decode_attention(q[:d], cache.key, cache.value, t.decode_tables, t.decode_lens,
                                                params, self.backend))
        if t.chunk_tables is not None:
            assert t.query_starts is not None and t.chunk_lens is not None
            parts.append(paged_prefill_attention(q[d:], cache.key, cache.value, t.chunk_tables, t.query_starts,
                                                 t.chunk_lens, t.max_query_len, params, self.backend))
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def kernel_metadata(tables: StepTables, window: int | None = None, backend: str = "auto") -> AttentionMetadata:
    """Attention metadata whose layers run through the kernels (``AttentionMetadata.ops``)."""
    return AttentionMetadata(block_size=tables.block_size, slot_mapping=tables.slot_mapping,
                             num_decodes=tables.num_decodes, sliding_window=window,
                             ops=KernelAttention(tables, window, backend))
