"""The compiled kernels on a GPU, in the dtypes the interpreter lacks (bfloat16, FP8 KV cache,
e4m3 weights), against their references on the same device. Skipped without a CUDA device."""

import pytest
import torch
from kernel_env import needs_cuda_triton

from chatfleet.engine.kernels.attention_params import AttentionParams
from chatfleet.engine.kernels.fp8_gemm import fp8_block_linear, fp8_block_linear_reference
from chatfleet.engine.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from chatfleet.engine.kernels.kv_store import store_kv, store_kv_reference
from chatfleet.engine.kernels.moe_router import topk_softmax, topk_softmax_reference
from chatfleet.engine.kernels.paged_decode import paged_decode_attention, paged_decode_reference
from chatfleet.engine.kernels.paged_prefill import paged_prefill_attention, paged_prefill_reference
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import quantize_weight
from chatfleet.engine.models.kv_cache import FP8, quantize_fp8

pytestmark = [pytest.mark.cuda, needs_cuda_triton]
DEV = "cuda"
BLOCK = 16


def paged(dtype, num_kv_heads=8, group=4, head_dim=128, lens=(1, 17, 300, 2048), seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    num_blocks = sum(-(-c // BLOCK) for c in lens) + 3
    key = torch.randn(num_kv_heads, num_blocks, BLOCK, head_dim, device=DEV, generator=g)
    value = torch.randn(num_kv_heads, num_blocks, BLOCK, head_dim, device=DEV, generator=g)
    perm = torch.randperm(num_blocks, device=DEV, generator=g).tolist()
    width = max(-(-c // BLOCK) for c in lens)
    tables, used = [], 0
    for c in lens:
        n = -(-c // BLOCK)
        tables.append(perm[used : used + n] + [-1] * (width - n))
        used += n
    if dtype == FP8:  # as the engine writes it: read back as fp8 * 0.05, no subnormal codes
        key, value = quantize_fp8(key * 0.05, 0.05), quantize_fp8(value * 0.05, 0.05)
        q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=DEV, dtype=torch.bfloat16, generator=g)
    else:
        key, value = key.to(dtype), value.to(dtype)
        q = torch.randn(len(lens), num_kv_heads * group, head_dim, device=DEV, generator=g).to(dtype)
    return q, key, value, torch.tensor(tables, dtype=torch.int32, device=DEV), torch.tensor(lens, dtype=torch.int32,
                                                                                             device=DEV)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16, FP8])
@pytest.mark.parametrize("window,softcap", [(None, None), (512, None), (None, 50.0)])
def test_decode_on_gpu(cache_dtype, window, softcap):
    q, key, value, tables, lens = paged(cache_dtype)
    params = AttentionParams(128**-0.5, window, softcap, k_scale=0.05, v_scale=0.05)
    got = paged_decode_attention(q, key, value, tables, lens, params, backend="triton")
    want = paged_decode_reference(q, key, value, tables, lens, params)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_prefill_on_gpu(cache_dtype):
    q1, key, value, tables, lens = paged(cache_dtype, lens=(100, 700, 2048))
    new = [100, 64, 300]  # a fresh prompt, then two prefix hits / later chunks
    starts = torch.tensor([0, 100, 164, 464], dtype=torch.int32, device=DEV)
    q = torch.randn(464, q1.shape[1], 128, device=DEV).to(q1.dtype)
    params = AttentionParams(128**-0.5, None, None, 0.05, 0.05)
    got = paged_prefill_attention(q, key, value, tables, starts, lens, max(new), params, backend="triton")
    want = paged_prefill_reference(q, key, value, tables, starts, lens, params)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_store_on_gpu(cache_dtype):
    k = torch.randn(33, 8, 128, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(33, 8, 128, device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(64 * BLOCK, device=DEV)[:33]
    slots[5] = -1
    got = [torch.zeros(8, 64, BLOCK, 128, device=DEV, dtype=cache_dtype) for _ in range(2)]
    want = [t.clone() for t in got]
    store_kv(k, v, *got, slots, 0.02, 0.03, backend="triton")
    store_kv_reference(k, v, *want, slots, 0.02, 0.03)
    for a, b in zip(got, want, strict=True):
        mismatched = (a.view(torch.uint8) != b.view(torch.uint8)).float().mean().item()
        assert mismatched < 1e-3  # FP8: rounding ties may differ between the two conversions


@pytest.mark.parametrize("m", [1, 8, 32, 64])
def test_fp8_gemm_on_gpu(m):
    w = torch.randn(4096 + 64, 4096, device=DEV)
    q, s = quantize_weight(w.cpu(), FP8WeightFormat("block", (128, 128)))
    q, s = q.to(DEV), s.to(DEV)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    got = fp8_block_linear(x, q, s, (128, 128), backend="triton")
    want = fp8_block_linear_reference(x, q, s, (128, 128))
    torch.testing.assert_close(got.float(), want.float(), atol=0.5, rtol=2e-2)


def test_fp8_gemm_large_m_on_gpu(capsys):
    """M > SMALL_M: cuBLAS block scaling where this torch/GPU has it (checked on first use), else
    the dequantizing reference; either way the reference's answer within FP8 activation error."""
    from chatfleet.engine.kernels import fp8_scaled_mm

    q, s = quantize_weight(torch.randn(1024, 2048), FP8WeightFormat("block", (128, 128)))
    q, s = q.to(DEV), s.to(DEV)
    x = torch.randn(256, 2048, device=DEV, dtype=torch.bfloat16)
    got = fp8_block_linear(x, q, s, (128, 128))
    want = fp8_block_linear_reference(x, q, s, (128, 128))
    assert ((got.float() - want.float()).abs().max() / want.float().abs().max()) < fp8_scaled_mm.CHECK_TOLERANCE
    with capsys.disabled():
        print(f"\ntorch._scaled_mm block scaling: {'used' if fp8_scaled_mm.verified() else 'not available'}")


def test_router_and_grouped_gemm_on_gpu():
    logits = torch.randn(64, 128, device=DEV)  # float32: no ties for the two to break differently
    scale = torch.rand(128, device=DEV) + 0.5
    got, want = topk_softmax(logits, 8, scale, backend="triton"), topk_softmax_reference(logits, 8, scale)
    assert torch.equal(got.experts, want.experts)
    torch.testing.assert_close(got.weights, want.weights)
    x = torch.randn(96, 512, device=DEV, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 10, 10, 50, 96], dtype=torch.int32, device=DEV)
    weight = torch.randn(4, 384, 512, device=DEV, dtype=torch.bfloat16)
    torch.testing.assert_close(grouped_gemm(x, offsets, weight, backend="triton").float(),
                               grouped_gemm_reference(x, offsets, weight).float(), atol=0.5, rtol=2e-2)
