"""The FP8 KV cache: stored bytes, clipping, and paged attention over it against plain attention
over the same keys and values as the cache returns them."""

from __future__ import annotations

import torch

from chatfleet.engine.models.attention import build_attention_metadata, causal_attention, paged_attention
from chatfleet.engine.models.kv_cache import FP8, KVCache, dequantize_fp8, quantize_fp8

HKV, HQ, D, BLOCK = 2, 4, 16, 4


def test_write_stores_scaled_e4m3_and_clips():
    cache = KVCache.allocate(4, BLOCK, HKV, D, FP8, "cpu", k_scale=0.5, v_scale=2.0)
    k = torch.randn(3, HKV, D)
    v = torch.randn(3, HKV, D)
    k[0, 0, 0] = 1000.0  # beyond 448 * 0.5: clipped
    cache.write(torch.tensor([5, 6, 13]), k, v)
    flat_k = cache.key.view(HKV, -1, D)
    assert flat_k.dtype == FP8
    assert flat_k[0, 5, 0].float() == 448.0
    expected = (k[1] / 0.5).to(FP8).float()
    assert torch.equal(flat_k[:, 6].float(), expected)
    assert torch.equal(dequantize_fp8(cache.value.view(HKV, -1, D)[:, 13], 2.0, torch.float32),
                       quantize_fp8(v[2], 2.0).float() * 2.0)
    assert cache.key.view(HKV, -1, D)[:, 7].float().abs().sum() == 0  # untouched slots stay zero


def test_paged_fp8_attention_equals_plain_attention_over_cache_values():
    torch.manual_seed(0)
    n = 22  # positions 0..21: a chunk of 10, a chunk of 7, then 5 single-token decodes
    q, k, v = torch.randn(n, HQ, D), torch.randn(n, HKV, D) * 3, torch.randn(n, HKV, D)
    cache = KVCache.allocate(8, BLOCK, HKV, D, FP8, "cpu", k_scale=0.02, v_scale=0.01)
    table = [6, 2, 7, 0, 3, 5]
    rk, rv = cache.round_trip(k, v)
    want = causal_attention(q, rk, rv, D**-0.5)
    got = torch.empty_like(q)
    steps = [(0, 10), (10, 7)] + [(p, 1) for p in range(17, 22)]
    for start, m in steps:
        if m == 1:
            meta = build_attention_metadata(BLOCK, [start + 1], [table], [], [], [], "cpu")
        else:
            meta = build_attention_metadata(BLOCK, [], [], [start], [m], [table], "cpu")
        s = slice(start, start + m)
        got[s] = paged_attention(q[s], k[s], v[s], cache, meta, D**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the cache differs from full precision: the test would notice a cache that is not FP8
    assert (rk - k).abs().max() > 1e-3
