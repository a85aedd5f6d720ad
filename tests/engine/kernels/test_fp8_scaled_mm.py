"""The cuBLAS block-scaled path's bookkeeping, with ``torch._scaled_mm`` stood in for on CPU: the
activation groups, the first-call check against the reference, and turning itself off."""

import pytest
import torch

from chatfleet.engine.kernels import fp8_scaled_mm
from chatfleet.engine.kernels.fp8_gemm import fp8_block_linear_reference
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import quantize_weight


def fake_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """What cuBLAS computes: (a * scale_a per 1x128 group) @ (b * scale_b per 128x128 block)."""
    left = a.float() * scale_a.repeat_interleave(128, dim=1)
    right = b.float() * scale_b.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
    return (left @ right).to(out_dtype)


@pytest.fixture
def case(monkeypatch):
    monkeypatch.setattr(fp8_scaled_mm, "_state", {})
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 384, generator=g) * torch.tensor([1.0, 50.0]).repeat_interleave(128)[:, None]
    q, s = quantize_weight(w, FP8WeightFormat("block", (128, 128)))  # the two row blocks' scales differ 50x
    x = torch.randn(80, 384, generator=g)
    return x, q, s, fp8_block_linear_reference(x, q, s, (128, 128))


def test_groups_quantize_per_token_and_128_columns():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 256, generator=g) * torch.tensor([1.0, 100.0]).repeat_interleave(128)
    q, scale = fp8_scaled_mm._quantize_groups(x)
    assert scale.shape == (5, 2) and scale.stride() == (1, 5)  # column-major, as cuBLAS reads it
    back = q.float() * scale.repeat_interleave(128, dim=1)
    spacing = scale.repeat_interleave(128, dim=1) * 2**-9  # e4m3's subnormal step, times the group's scale
    assert ((back - x).abs() <= x.abs() * 2**-4 + spacing).all()  # 3 mantissa bits: half a step 2**-4


def test_verified_once_then_trusted(monkeypatch, case):
    x, q, s, ref = case
    monkeypatch.setattr(torch, "_scaled_mm", fake_scaled_mm)
    y = fp8_scaled_mm.scaled_mm_block(x, q, s, ref)
    assert y is not None and fp8_scaled_mm.verified()
    assert ((y - ref).abs().max() / ref.abs().max()) < fp8_scaled_mm.CHECK_TOLERANCE
    assert fp8_scaled_mm.scaled_mm_block(x, q, s) is not None  # no reference needed any more


@pytest.mark.parametrize("failure", ["raises", "misreads"])
def test_refusal_or_wrong_answer_turns_it_off(monkeypatch, case, failure):
    x, q, s, ref = case

    def broken(a, b, scale_a, scale_b, out_dtype):
        if failure == "raises":
            raise RuntimeError("block scaling needs sm90 and CUDA 12.9")
        return fake_scaled_mm(a, b, scale_a, scale_b.flip(1), out_dtype)  # the row blocks' scales swapped

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    assert fp8_scaled_mm.scaled_mm_block(x, q, s, ref) is None
    assert fp8_scaled_mm._state == {"off": True} and not fp8_scaled_mm.verified()
