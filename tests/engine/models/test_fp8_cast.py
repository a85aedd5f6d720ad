"""The float16-layout FP8 conversion is exact for every finite e4m3 code, in every dtype."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.models.fp8_cast import FP8_DOWN, fp8_to_down


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_code_converts_exactly(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    finite = ~want.isnan()
    got = fp8_to_down(codes, dtype).float() * FP8_DOWN
    assert torch.equal(got[finite], want[finite])
    out = torch.empty(256, dtype=dtype)
    assert fp8_to_down(codes, dtype, out) is out and torch.equal(out.float()[finite] * FP8_DOWN, want[finite])
