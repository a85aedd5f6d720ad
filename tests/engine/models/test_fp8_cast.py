"""Both FP8 conversions are exact for every finite e4m3 code, in every dtype; the scaled one
rounds exactly as PyTorch's own conversion followed by the same multiplication."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.models.fp8_cast import FP8_DOWN, fp8_dequantize, fp8_placed, fp8_to_down, placed_down

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
