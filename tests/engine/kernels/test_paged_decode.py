"""Paged decode attention: the Triton kernel (interpreted) against the engine's decode path, and
the soft-capped / FP8 references against plain attention over the dequantized cache."""

import pytest
import torch
from kernel_env import HAS_TRITON, needs_interpreter

from chatfleet.engine.kernels.attention_params import AttentionParams, dense_attention
from chatfleet.engine.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from chatfleet.engine.models.kv_cache import FP8, quantize_fp8

BLOCK = 16
LENS = [1, 16, 17, 40, 75]  # one token, a full block, one past it, partial blocks


def paged_case(num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A cache of 14 blocks, five sequences with scattered tables (-1 past each context end)."""
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(num_kv_heads, 14, BLOCK, head_dim, generator=g).to(dtype)
    value = torch.randn(num_kv_heads, 14, BLOCK, head_dim, generator=g).to(dtype)
    perm = torch.randperm(14, generator=g).tolist()
    tables, used = [], 0
    for ctx in LENS:
        n = -(-ctx // BLOCK)
        tables.append(perm[used : used + n] + [-1] * (5 - n))
        used = (used + n) % 10
    q = torch.randn(len(LENS), num_kv_heads * group, head_dim, generator=g).to(dtype)
    return q, key, value, torch.tensor(tables, dtype=torch.int32), torch.tensor(LENS, dtype=torch.int32)


def dense_decode(q, key, value, tables, lens, params):
    """Plain attention per sequence over its whole context, dequantized (the oracle)."""
    out = []
    for i, ctx in enumerate(lens.tolist()):
        ids = tables[i, : -(-ctx // BLOCK)].long()
        k = key[:, ids].reshape(key.shape[0], -1, key.shape[3])[:, :ctx].float()
        v = value[:, ids].reshape(key.shape[0], -1, key.shape[3])[:, :ctx].float()
        if key.dtype == FP8:
            k, v = k * params.k_scale, v * params.v_scale
        out.append(dense_attention(q[i : i + 1].float(), k, v, torch.tensor([ctx - 1]), torch.arange(ctx), params))
    return torch.cat(out)


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(2, 3, 32), (1, 1, 16), (2, 4, 24)])
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 4.0), (7, 2.0)])
def test_triton_matches_reference(dtype, tol, num_kv_heads, group, head_dim, window, softcap):
    q, key, value, tables, lens = paged_case(num_kv_heads, group, head_dim, dtype)
    params = AttentionParams(head_dim**-0.5 if softcap is None else 1.0, window, softcap)
    got = paged_decode_attention(q, key, value, tables, lens, params, backend="triton")
    want = paged_decode_reference(q, key, value, tables, lens, params)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("num_splits", [2, 3, 5])  # 5: one block per split, some splits empty
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (7, 2.0)])
def test_triton_context_splits_merge_to_the_reference(dtype, tol, num_splits, window, softcap):
    from chatfleet.engine.kernels.paged_decode_triton import paged_decode_triton

    q, key, value, tables, lens = paged_case(2, 3, 32, dtype, seed=2)
    params = AttentionParams(0.2, window, softcap)
    got = paged_decode_triton(q, key, value, tables, lens, params, num_splits=num_splits)
    torch.testing.assert_close(got.float(), paged_decode_reference(q, key, value, tables, lens, params).float(),
                               atol=tol, rtol=tol)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_split_count_uses_host_sizes_only():
    from chatfleet.engine.kernels.paged_decode_triton import MIN_BLOCKS_PER_SPLIT, choose_splits

    assert choose_splits(1, 8, 128, torch.device("cpu")) == 1  # the interpreter: one split unless asked
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        assert choose_splits(64, 8, 128, dev) == 1  # enough programs already
        assert 1 < choose_splits(1, 8, 128, dev) <= 128 // MIN_BLOCKS_PER_SPLIT


@needs_interpreter
def test_triton_applies_kv_scales_and_reads_k_as_v():
    """K=V layers pass one tensor for both; the scales path (FP8's) on a float16 cache."""
    q, key, _, tables, lens = paged_case(2, 2, 32, torch.float16, seed=1)
    params = AttentionParams(0.2, k_scale=0.5, v_scale=3.0)
    from chatfleet.engine.kernels.paged_decode_triton import paged_decode_triton

    got = paged_decode_triton(q, key, key, tables, lens, params, scaled=True)
    want = paged_decode_reference(q.float(), key.float() * 0.5, key.float() * 3.0, tables, lens,
                                  AttentionParams(0.2)).to(torch.float16)
    torch.testing.assert_close(got, want, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("window", [None, 9])
def test_engine_reference_equals_plain_attention(window):
    q, key, value, tables, lens = paged_case(2, 3, 32, torch.float32)
    params = AttentionParams(32**-0.5, window)
    torch.testing.assert_close(paged_decode_reference(q, key, value, tables, lens, params),
                               dense_decode(q, key, value, tables, lens, params), atol=1e-5, rtol=1e-5)


def test_softcap_reference_caps_the_scores():
    q, key, value, tables, lens = paged_case(2, 2, 16, torch.float32)
    capped = paged_decode_reference(q * 8, key, value, tables, lens, AttentionParams(1.0, softcap=1.0))
    loose = paged_decode_reference(q * 8, key, value, tables, lens, AttentionParams(1.0, softcap=1e6))
    plain = paged_decode_reference(q * 8, key, value, tables, lens, AttentionParams(1.0))
    torch.testing.assert_close(loose, plain, atol=1e-4, rtol=1e-4)  # a huge cap changes nothing
    assert (capped - plain).abs().max() > 0.1  # a cap of 1 flattens the softmax
    torch.testing.assert_close(capped, dense_decode(q * 8, key, value, tables, lens, AttentionParams(1.0, softcap=1.0)))


def test_fp8_cache_reference_reads_dequantized_blocks():
    q, key, value, tables, lens = paged_case(2, 2, 32, torch.float32)
    params = AttentionParams(32**-0.5, k_scale=0.02, v_scale=0.05)
    k8, v8 = quantize_fp8(key * 0.02, 0.02), quantize_fp8(value * 0.05, 0.05)
    got = paged_decode_reference(q, k8, v8, tables, lens, params)
    torch.testing.assert_close(got, dense_decode(q, k8, v8, tables, lens, params), atol=1e-4, rtol=1e-4)


def test_auto_on_cpu_is_the_reference():
    q, key, value, tables, lens = paged_case(2, 2, 32, torch.float32)
    params = AttentionParams(0.3, 20)
    assert torch.equal(paged_decode_attention(q, key, value, tables, lens, params),
                       paged_decode_reference(q, key, value, tables, lens, params))
