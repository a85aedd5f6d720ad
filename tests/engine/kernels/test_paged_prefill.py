"""Paged prefill attention: chunks over the cache (fresh prompts, prefix hits, later chunks of
a chunked prefill), the Triton kernel (interpreted) against the reference, and the reference
against the engine's ``paged_attention`` for the same step."""

import pytest
import torch
from kernel_env import needs_interpreter

from chatfleet.engine.kernels.attention_params import AttentionParams, dense_attention
from chatfleet.engine.kernels.kv_store import store_kv
from chatfleet.engine.kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
from chatfleet.engine.models.attention import KVCache, build_attention_metadata, paged_attention

BLOCK = 16
CACHED = [0, 32, 40, 7]  # tokens already in the cache: fresh prompt, block-aligned hit, mid-block
NEW = [20, 5, 19, 1]
TABLES = [[3, 1, -1, -1], [5, 2, 11, -1], [7, 0, 9, 4], [6, -1, -1, -1]]


def step(num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_kv_heads, 12, BLOCK, head_dim, generator=g).to(dtype)
    value = torch.randn(num_kv_heads, 12, BLOCK, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(NEW), num_kv_heads * group, head_dim, generator=g).to(dtype)
    starts = torch.tensor([0] + torch.tensor(NEW).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor([c + n for c, n in zip(CACHED, NEW, strict=True)], dtype=torch.int32)
    return q, key, value, torch.tensor(TABLES, dtype=torch.int32), starts, lens


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 2, 32), (1, 3, 24)])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0), (7, 2.0)])
def test_triton_matches_reference(dtype, tol, num_kv_heads, group, head_dim, window, softcap):
    q, key, value, tables, starts, lens = step(num_kv_heads, group, head_dim, dtype)
    params = AttentionParams(head_dim**-0.5 if softcap is None else 0.5, window, softcap)
    got = paged_prefill_attention(q, key, value, tables, starts, lens, max(NEW), params, backend="triton")
    want = paged_prefill_reference(q, key, value, tables, starts, lens, params)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_interpreter
def test_triton_scaled_and_k_as_v():
    from chatfleet.engine.kernels.paged_prefill_triton import paged_prefill_triton

    q, key, _, tables, starts, lens = step(2, 2, 32, torch.float32, seed=2)
    got = paged_prefill_triton(q, key, key, tables, starts, lens, max(NEW), AttentionParams(0.2, None, None, 0.5, 3.0),
                               scaled=True)
    want = paged_prefill_reference(q, key * 0.5, key * 3.0, tables, starts, lens, AttentionParams(0.2))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [None, 12])
def test_reference_equals_engine_paged_attention(window):
    """One step of four chunks through the engine: store into the cache, then attend."""
    q, key, value, tables, starts, lens = step(2, 2, 32, torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    k_new = torch.randn(sum(NEW), 2, 32, generator=g)
    v_new = torch.randn(sum(NEW), 2, 32, generator=g)
    meta = build_attention_metadata(BLOCK, [], [], CACHED, NEW, TABLES, "cpu", sliding_window=window)
    cache = KVCache(key.clone(), value.clone())
    want = paged_attention(q, k_new, v_new, cache, meta, 0.3)
    store_kv(k_new, v_new, key, value, meta.slot_mapping)
    assert torch.equal(key, cache.key) and torch.equal(value, cache.value)
    got = paged_prefill_attention(q, key, value, tables, starts, lens, max(NEW), AttentionParams(0.3, window))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_softcap_reference_is_dense_attention():
    q, key, value, tables, starts, lens = step(1, 2, 16, torch.float32)
    params = AttentionParams(1.0, None, 3.0)
    got = paged_prefill_reference(q, key, value, tables, starts, lens, params)
    ctx = CACHED[1] + NEW[1]
    ids = torch.tensor(TABLES[1][:3])
    k = key[:, ids].reshape(1, -1, 16)[:, :ctx]
    v = value[:, ids].reshape(1, -1, 16)[:, :ctx]
    want = dense_attention(q[20:25], k, v, torch.arange(32, 37), torch.arange(ctx), params)
    torch.testing.assert_close(got[20:25], want)
