"""The FP8 KV cache: stored bytes, clipping, and paged attention over it against plain attention
over the same keys and values as the cache returns them."""

from __future__ import annotations

import torch

from chatfleet.engine.models.attention import build_attention_metadata, causal_attention, paged_attention
from chatfleet.engine.models.fp8_cast import to_e4m3_normal
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
    expected = to_e4m3_normal(k[1] / 0.5).float()
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


def test_bf16_decodes_over_an_fp8_cache_match_attention_over_its_values():
    """Decodes fold the K/V scales and the bit placement into the scores and the output; the
    result equals float64 attention over the values the cache holds, to bf16's precision, for
    tiny and large queries alike (products of placed bits are kept out of the subnormals)."""
    torch.manual_seed(3)
    d, hkv, hq, dim, ctx, block = 3, 2, 4, 64, 37, 8
    table = [list(range(i * 5, i * 5 + 5)) for i in range(d)]
    cache = KVCache.allocate(5 * d, block, hkv, dim, FP8, "cpu", k_scale=0.05, v_scale=0.002)
    for i in range(d):
        k, v = torch.randn(ctx, hkv, dim) * 4, torch.randn(ctx, hkv, dim) * 0.3
        slots = torch.tensor([table[i][p // block] * block + p % block for p in range(ctx)])
        cache.write(slots, k, v)
    keys = cache.key.double() * 0.05  # PyTorch's own conversion of what the cache holds
    values = cache.value.double() * 0.002
    for q_size in (1e-3, 1.0, 30.0):
        q = (torch.randn(d, hq, dim) * q_size).bfloat16()
        meta = build_attention_metadata(block, [ctx] * d, table, [], [], [], "cpu")
        got = paged_attention(q, q[:, :hkv], q[:, :hkv], cache, meta, dim**-0.5, write=False)
        for i in range(d):
            ids = torch.tensor(table[i])
            k = keys[:, ids].reshape(hkv, -1, dim)[:, :ctx].repeat_interleave(hq // hkv, 0)
            v = values[:, ids].reshape(hkv, -1, dim)[:, :ctx].repeat_interleave(hq // hkv, 0)
            probs = (q[i].double().unsqueeze(1) @ k.transpose(1, 2) * dim**-0.5).softmax(-1)
            want = (probs @ v).squeeze(1)
            torch.testing.assert_close(got[i].double(), want, atol=2e-2 * float(want.abs().max()), rtol=2e-2)


def test_small_values_survive_folded_fp8_decodes():
    """A value dimension far under the layer's largest, spread over a long context: each
    product of a probability and a placed code would be a subnormal without the scale-up, and
    matrix kernels flush those to zero."""
    torch.manual_seed(4)
    hkv, hq, dim, ctx, block = 2, 4, 64, 300, 16
    table = list(range(ctx // block + 1))
    cache = KVCache.allocate(len(table), block, hkv, dim, FP8, "cpu", k_scale=0.05, v_scale=0.002)
    v = torch.randn(ctx, hkv, dim) * 0.3
    v[:, :, 0] = 1e-4  # code ~0.05: a normal e4m3 value
    slots = torch.tensor([table[p // block] * block + p % block for p in range(ctx)])
    cache.write(slots, torch.randn(ctx, hkv, dim), v)
    want = cache.value.view(hkv, -1, dim)[:, slots, 0].double().mean(1) * 0.002  # uniform attention
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.zeros(1, hq, dim, dtype=dtype)
        meta = build_attention_metadata(block, [ctx], [table], [], [], [], "cpu")
        got = paged_attention(q, q[:, :hkv], q[:, :hkv], cache, meta, dim**-0.5, write=False)
        torch.testing.assert_close(got[0, :, 0].double(), want.repeat_interleave(hq // hkv), rtol=2e-2, atol=0)
