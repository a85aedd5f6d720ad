"""Block-scaled FP8 GEMM: the Triton kernel (interpreted; the weight's exact e4m3 values passed
as float16/float32, the interpreter having no FP8) against the engine's dequantize-then-linear,
partial edge tiles and non-square scale blocks included."""

import pytest
import torch
from kernel_env import needs_interpreter

from chatfleet.engine.kernels.fp8_gemm import SMALL_M, fp8_block_linear, fp8_block_linear_reference
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import FP8Linear, quantize_weight


def quantized(n: int, k: int, block: tuple[int, int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of different ranges
    return quantize_weight(w, FP8WeightFormat("block", block))


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("m,n,k,block", [(1, 200, 256, (128, 128)), (3, 72, 96, (32, 32)),
                                         (17, 40, 64, (16, 32)), (40, 50, 48, (16, 16))])
def test_triton_matches_dequantized_linear(dtype, tol, m, n, k, block):
    q, s = quantized(n, k, block)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dtype)
    bias = torch.randn(n).to(dtype)
    from chatfleet.engine.kernels.fp8_gemm_triton import fp8_block_linear_triton

    got = fp8_block_linear_triton(x, q.to(dtype), s, block) + bias
    want = fp8_block_linear_reference(x, q, s, block, bias)
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float() / scale, want.float() / scale, atol=tol, rtol=0)


def test_reference_is_what_fp8_linear_computes():
    q, s = quantized(72, 96, (32, 32))
    layer = FP8Linear(96, [72], FP8WeightFormat("block", (32, 32)))
    layer.set_part(0, q, s)
    x = torch.randn(5, 96)
    assert torch.equal(fp8_block_linear(x, q, s, (32, 32)), layer(x))


def test_auto_on_cpu_and_large_m_take_the_reference():
    q, s = quantized(40, 64, (16, 16))
    for m in (2, SMALL_M + 1):
        x = torch.randn(m, 64)
        assert torch.equal(fp8_block_linear(x, q, s, (16, 16)), fp8_block_linear_reference(x, q, s, (16, 16)))
    x3 = torch.randn(2, 3, 64)
    assert fp8_block_linear(x3, q, s, (16, 16)).shape == (2, 3, 40)
