"""Both FP8 conversions are exact for every finite e4m3 code, in every dtype; the scaled one
rounds exactly as PyTorch's own conversion followed by the same multiplication."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.models.fp8_cast import (
    E4M3_MIN_NORMAL,
    FP8_DOWN,
    fp8_dequantize,
    fp8_placed,
    fp8_to_down,
    placed_down,
    to_e4m3_normal,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
WANT = CODES.float()  # PyTorch's own (element by element) conversion
FINITE = ~WANT.isnan()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_converts_exactly(dtype):
    got = fp8_to_down(CODES, dtype).float() * FP8_DOWN
    assert torch.equal(got[FINITE], WANT[FINITE])
    out = torch.empty(256, dtype=dtype)
    assert fp8_to_down(CODES, dtype, out) is out and torch.equal(out.float()[FINITE] * FP8_DOWN, WANT[FINITE])


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_code_places_exactly(dtype):
    got = fp8_placed(CODES, dtype).double() * placed_down(dtype)  # float64: the placed subnormals scale exactly
    assert torch.equal(got[FINITE].float(), WANT[FINITE])
    out = torch.empty(2, 128, dtype=dtype)
    assert fp8_placed(CODES.view(2, 128), dtype, out) is out
    assert torch.equal((out.double() * placed_down(dtype)).view(-1)[FINITE].float(), WANT[FINITE])
    # zero, the smallest subnormal, the largest subnormal, the smallest normal, the largest: by value
    for bits, value in [(0x00, 0.0), (0x01, 2.0**-9), (0x07, 7 * 2.0**-9), (0x08, 2.0**-6), (0x7E, 448.0),
                        (0x80, -0.0), (0x81, -(2.0**-9)), (0xFE, -448.0)]:
        code = torch.tensor([bits], dtype=torch.uint8).view(torch.float8_e4m3fn)
        assert float(fp8_placed(code, dtype).double() * placed_down(dtype)) == value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.00123, 3.7, 2.0**-20, 300.0, 1e30])
def test_dequantize_rounds_like_torch(dtype, scale):
    """One rounding, from float32 (a scale too large to fold with the placement included)."""
    want = (WANT * scale).to(dtype)
    got = fp8_dequantize(CODES, scale, dtype)
    assert got.dtype == dtype
    assert torch.equal(got[FINITE], want[FINITE])


def test_placement_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        fp8_placed(CODES, torch.int32)


def test_normal_only_rounding_leaves_no_subnormal_code():
    """Every finite e4m3 value and the midpoints between them: normal values round as PyTorch
    rounds them; magnitudes under 2**-6 go to 0 or +-2**-6, whichever is nearer."""
    values = WANT[FINITE].sort().values
    y = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor([0.001, -0.005, 0.0079, -0.0117])])
    got = to_e4m3_normal(y)
    bits = got.view(torch.uint8)
    assert not bool((((bits & 0x78) == 0) & ((bits & 0x07) != 0)).any())
    normal = y.abs() >= E4M3_MIN_NORMAL
    assert torch.equal(got.float()[normal], y[normal].to(torch.float8_e4m3fn).float())
    tiny = ~normal
    nearest = torch.where(y[tiny].abs() >= E4M3_MIN_NORMAL / 2, y[tiny].sign() * E4M3_MIN_NORMAL, 0.0)
    assert torch.equal(got.float()[tiny].abs(), nearest.abs())
