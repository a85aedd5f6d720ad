"""The q/k norm + RoPE C++ kernel against its torch-op reference (the path it replaces)."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.models import qk_norm_rope as m
from chatfleet.engine.models.dtype import native_bf16
from chatfleet.engine.models.qwen3 import Rotary

pytestmark = pytest.mark.skipif(not m.available(), reason="no C++ compiler: the torch ops run")

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not native_bf16(torch.device("cpu")), reason="the CPU emulates bfloat16"))]


def _case(tokens: int, heads: int, head_dim: int, extra: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, heads * head_dim + extra, generator=g) * 3).to(dtype)
    weight = (torch.randn(heads, head_dim, generator=g) * 0.5 + 1).to(dtype)
    cos, sin = Rotary(head_dim, 1e6, 4096, dtype, "cpu").lookup(torch.randint(0, 4096, (tokens,), generator=g))
    return qkv, weight, cos, sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,head_dim,extra", [(1, 10, 64, 128), (37, 10, 64, 128), (300, 6, 48, 0),
                                                         (5, 3, 128, 256), (9, 2, 10, 4), (4, 5, 32, 0),
                                                         (3, 2, 256, 64)])
def test_the_kernel_equals_the_torch_ops(dtype, tokens, heads, head_dim, extra):
    qkv, weight, cos, sin = _case(tokens, heads, head_dim, extra, dtype, tokens * heads + head_dim)
    want = m.qk_norm_rope_torch(qkv[:, : heads * head_dim].view(tokens, heads, head_dim), weight, cos, sin, 1e-6)
    got = m.qk_norm_rope(qkv, heads, head_dim, weight, cos, sin, 1e-6)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.float32:  # the sum of squares in another order: within a few ulps
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # rounds where the torch ops round: nearly every element to the bit, the rest one ulp off
        differ = got != want
        assert differ.float().mean().item() < 1e-3
        assert torch.all((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6)


def test_a_strided_view_falls_back_to_the_torch_ops():
    qkv, weight, cos, sin = _case(8, 4, 16, 32, torch.float32, 0)
    strided = qkv.t().contiguous().t()  # column-major: the kernel's rows are not contiguous
    want = m.qk_norm_rope_torch(qkv[:, :64].view(8, 4, 16), weight, cos, sin, 1e-6)
    torch.testing.assert_close(m.qk_norm_rope(strided, 4, 16, weight, cos, sin, 1e-6), want, rtol=2e-6, atol=2e-6)


@pytest.mark.skipif(not native_bf16(torch.device("cpu")), reason="the CPU emulates bfloat16")
def test_denormal_and_zero_bf16_results_round_like_the_torch_ops():
    """Weights near the smallest normal make the scaled heads and their rotations denormal, and
    a zero head normalizes to zeros: the vector path's fast bf16 rounding (vcvtneps2bf16) would
    flush those to zero, so they must take the exact one."""
    dtype = torch.bfloat16
    qkv, weight, cos, sin = _case(40, 10, 64, 128, dtype, 7)
    weight = (weight.float() * 2.0**-130).to(dtype)  # bf16 keeps denormals
    qkv[3, 64:128] = 0
    want = m.qk_norm_rope_torch(qkv[:, :640].view(40, 10, 64), weight, cos, sin, 1e-6)
    assert (want != 0).float().mean().item() > 0.9 and want.float().abs().max().item() < 2.0**-126
    got = m.qk_norm_rope(qkv, 10, 64, weight, cos, sin, 1e-6)
    assert (got != want).float().mean().item() < 1e-3
    assert torch.equal(got[3, 1], want[3, 1])
