"""Fast, exact FP8 (e4m3) to 16/32-bit conversion on CPU, through the float16 bit layout.

PyTorch converts ``float8_e4m3fn`` element by element (on CPU several times slower than a
float16 conversion). The e4m3 bits ``s eeee mmm`` (exponent bias 7) placed at float16's
``s 0eeee mmm0000000`` (bias 15) are the same number divided by 2**8, normal and subnormal
alike; three integer operations do it for a whole tensor (then float16 -> float32, and on to
bfloat16 when asked: both vectorized casts). Every finite e4m3 value converts
exactly (the NaN code, never written here, does not).
"""

from __future__ import annotations

import torch

FP8_DOWN = 256.0  # fp8_to_down returns the value divided by this (a power of two: exact)


def fp8_to_down(q: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` (e4m3) as ``dtype``, divided by ``FP8_DOWN`` (exact); into ``out`` when given."""
    x = q.view(torch.int8).to(torch.int16)  # sign-extended: bits 7..15 copy the sign bit
    x <<= 7
    x &= ~0x4000  # keep the sign at bit 15 only
    half = x.view(torch.float16)
    if dtype != torch.float32:  # float16 -> bfloat16 directly is slow on CPU; through float32 is not
        half = half.float()
    if out is None:
        return half.to(dtype)
    return out.copy_(half)
