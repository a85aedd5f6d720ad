"""Fast, exact FP8 (e4m3) to 16/32-bit conversion on CPU, through bit placement.

PyTorch converts ``float8_e4m3fn`` element by element (on CPU several times slower than a
float16 conversion). Placing the e4m3 bits ``s eeee mmm`` (exponent bias 7) into a wider
float's bits gives the same number times a power of two, normal and subnormal codes alike,
in three integer operations over the tensor (widen, shift, mask):

- ``fp8_placed``: the bits straight into the target dtype. In bfloat16 and float32
  (``s 0000eeee mmm...``, bias 127) that is the value divided by ``2**120``; in float16
  (``s 0eeee mmm0000000``, bias 15) divided by ``2**8``. Codes with a zero exponent land on
  subnormals of the target, so the result must be multiplied by a scale (``placed_down``
  folded into it) before it goes into a product: matrix kernels may read subnormal inputs as
  zero. ``fp8_dequantize`` does both.
- ``fp8_to_down``: through the float16 layout (value / ``FP8_DOWN``, 256), then float32 and
  the target: two more (wider) passes, but every result is a normal number of the target,
  safe in a product before its scale is applied (the FP8 embedding's output projection).

Every finite e4m3 code converts exactly both ways (the NaN code, never written here, does
not). The placement's exactness needs subnormals kept in the scale multiplication: PyTorch's
default (``torch.set_flush_denormal(True)`` would zero the 14 subnormal codes).
"""

from __future__ import annotations

import torch

FP8_DOWN = 256.0  # fp8_to_down returns the value divided by this (a power of two: exact)
E4M3_MIN_NORMAL = 2.0**-6

# dtype -> (same-width integer dtype, left shift of the sign-extended code, mask keeping the
# sign bit and the 7 placed bits, power of two the placed value is divided by).
_PLACEMENT: dict[torch.dtype, tuple[torch.dtype, int, int, float]] = {
    torch.bfloat16: (torch.int16, 4, -0x7810, 2.0**120),  # 0x87F0 as int16
    torch.float32: (torch.int32, 20, -0x78100000, 2.0**120),  # 0x87F00000 as int32
    torch.float16: (torch.int16, 7, -0x4001, 2.0**8),  # ~0x4000: sign at bit 15 only
}


def placed_down(dtype: torch.dtype) -> float:
    """The power of two ``fp8_placed`` divides by in ``dtype``."""
    return _placement(dtype)[3]


def _placement(dtype: torch.dtype) -> tuple[torch.dtype, int, int, float]:
    try:
        return _PLACEMENT[dtype]
    except KeyError:
        raise ValueError(f"FP8 converts to float32, bfloat16 or float16, not {dtype}") from None


def fp8_placed(q: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` (e4m3) as ``dtype`` divided by ``placed_down(dtype)`` (exact; see the module doc:
    scale it before any product); into ``out`` when given."""
    int_dtype, shift, mask, _ = _placement(dtype)
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=q.device)
    x = out.view(int_dtype)
    x.copy_(q.view(torch.int8))  # sign-extended: the high bits copy the sign bit
    x <<= shift
    x &= mask
    return out


def fp8_dequantize(q: torch.Tensor, scale: float, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q * scale`` in ``dtype`` (into ``out`` when given), rounded once (from float32)."""
    w = fp8_placed(q, dtype, out)
    down = placed_down(dtype)
    if scale * down < torch.finfo(torch.float32).max:
        return w.mul_(scale * down)
    return w.mul_(down).mul_(scale)  # a huge scale: undo the placement first


def fp8_to_down(q: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` (e4m3) as ``dtype``, divided by ``FP8_DOWN`` (exact, never subnormal in bfloat16 or
    float32); into ``out`` when given."""
    x = q.view(torch.int8).to(torch.int16)  # sign-extended: bits 7..15 copy the sign bit
    x <<= 7
    x &= ~0x4000  # keep the sign at bit 15 only
    half = x.view(torch.float16)
    if dtype != torch.float32:  # float16 -> bfloat16 directly is slow on CPU; through float32 is not
        half = half.float()
    if out is None:
        return half.to(dtype)
    return out.copy_(half)


def to_e4m3_normal(y: torch.Tensor) -> torch.Tensor:
    """``y`` (float32, within +-448) as e4m3 without subnormal codes: magnitudes under the
    smallest normal (2**-6, 1/28,672 of the largest) round to 0 or 2**-6, so products with
    ``fp8_placed`` values never meet a subnormal input (the FP8 KV cache is written so)."""
    a = y.abs()
    snapped = torch.where(a >= E4M3_MIN_NORMAL / 2, y.sign() * E4M3_MIN_NORMAL, 0.0)
    return torch.where(a < E4M3_MIN_NORMAL, snapped, y).to(torch.float8_e4m3fn)
