"""Paged prefill attention: multi-token query chunks over the paged cache (chunked prefill and
prefix-cache hits).

``paged_prefill_attention(q, key, value, block_tables, query_starts, context_lens,
max_query_len, params)``: chunk ``b`` holds queries ``q[query_starts[b] : query_starts[b + 1]]``
at positions ``ctx_b - n_b .. ctx_b - 1`` (``ctx_b = context_lens[b]``, ``n_b`` its length); each
attends causally to every earlier position of its sequence, read from the cache through
``block_tables[b]`` (the chunk's own keys and values are stored first: ``kv_store.store_kv``).
Positions before the chunk are the cached prefix (a prefix hit or earlier chunks). The
window, softcap, GQA and FP8 scales follow ``params``, as in ``paged_decode.py``;
``max_query_len`` (a host int: the launch grid's size) bounds every ``n_b``.

Reference: per chunk, the context gathered from the cache and the engine's ``chunk_attention``
(the ``torch`` path ``paged_attention`` runs); with a softcap, dense float32 attention.
"""

from __future__ import annotations

import torch

from chatfleet.engine.kernels.attention_params import AttentionParams, dense_attention
from chatfleet.engine.kernels.backend import resolve_backend
from chatfleet.engine.kernels.paged_decode import unsupported_reason
from chatfleet.engine.kernels.paged_read import first_block, read_context
from chatfleet.engine.models.prefill_attention import chunk_attention


def paged_prefill_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                            query_starts: torch.Tensor, context_lens: torch.Tensor,
                            params: AttentionParams) -> torch.Tensor:
    block_size = key.shape[2]
    starts, lens, tables = query_starts.tolist(), context_lens.tolist(), block_tables.tolist()
    out = torch.empty_like(q)
    for b, (ctx, table) in enumerate(zip(lens, tables, strict=True)):
        qs, qe = starts[b], starts[b + 1]
        if qe == qs:
            continue
        start = ctx - (qe - qs)
        first = first_block(start, params.window, block_size)
        k = read_context(key, table, first, ctx, params.k_scale, q.dtype)
        v = read_context(value, table, first, ctx, params.v_scale, q.dtype)
        if params.softcap is None:
            out[qs:qe] = chunk_attention(q[qs:qe], k, v, start, params.scale, "torch", params.window,
                                         first * block_size)
        else:
            q_pos = torch.arange(start, ctx, device=q.device)
            k_pos = torch.arange(first * block_size, ctx, device=q.device)
            out[qs:qe] = dense_attention(q[qs:qe], k, v, q_pos, k_pos, params)
    return out


def paged_prefill_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                            query_starts: torch.Tensor, context_lens: torch.Tensor, max_query_len: int,
                            params: AttentionParams, backend: str = "auto") -> torch.Tensor:
    """q [N, Hq, D] (the chunks one after another) over the paged cache -> [N, Hq, D]."""
    tensors = (q, key, value, block_tables, query_starts, context_lens)
    if resolve_backend(backend, tensors, unsupported_reason(q, key, value)) == "torch":
        return paged_prefill_reference(q, key, value, block_tables, query_starts, context_lens, params)
    from chatfleet.engine.kernels.paged_prefill_triton import paged_prefill_triton

    return paged_prefill_triton(q, key, value, block_tables, query_starts, context_lens, max_query_len, params)
