"""Block-scaled FP8 weight GEMM for small batches: ``y = x (W * S)^T (+ b)``.

``fp8_block_linear(x, weight, scale, block, bias)``: x [M, K] (float16, bfloat16 or float32),
``weight`` [N, K] e4m3 with float32 ``scale`` [ceil(N / bn), ceil(K / bk)] for ``block = (bn,
bk)`` (the ``[128, 128]`` format of DeepSeek-V3 and Qwen3-FP8, edge tiles partial). The kernel
reads the FP8 weight as it is stored (half the bytes of a bfloat16 weight: a decode step's
linears are bound by those bytes for M up to about 64), widens each tile to x's dtype, and
applies the tile's scale to its float32 partial product: it never writes a dequantized weight.
Above ``SMALL_M`` rows the product is compute-bound: on CUDA ``auto`` tries cuBLAS's FP8 GEMM
with 1x128 / 128x128 block scaling (``fp8_scaled_mm.py``, checked against the reference on its
first call), and otherwise takes the reference, whose one dequantization is amortised there.

Reference: the engine's ``dequantize_weight`` then ``F.linear`` (what ``FP8Linear`` does for
block scales today). Per-tensor and per-channel scales are not this kernel's: ``FP8Linear``
sends them to ``torch._scaled_mm`` on CUDA already.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatfleet.engine.kernels.backend import interpreting, reference_forced, resolve_backend
from chatfleet.engine.kernels.fp8_scaled_mm import can_use, scaled_mm_block, verified
from chatfleet.engine.models.fp8_format import FP8WeightFormat, ceil_div
from chatfleet.engine.models.fp8_linear import FP8, dequantize_weight

SMALL_M = 64


def fp8_block_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize_weight(weight, scale, FP8WeightFormat("block", block), x.dtype)
    return F.linear(x, w, bias)


def unsupported_reason(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int]) -> str | None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return "x must be [M, K] and the weight [N, K]"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activations in {x.dtype}"
    if tuple(scale.shape) != (ceil_div(weight.shape[0], block[0]), ceil_div(weight.shape[1], block[1])):
        return f"scales {tuple(scale.shape)} do not tile the weight in {block} blocks"
    if block[1] < 16 or block[1] & (block[1] - 1):
        return f"scale block width {block[1]} (needs a power of two >= 16)"
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return "rows are not contiguous"
    if not x.is_cuda and interpreting() and (weight.dtype == FP8 or x.dtype == torch.bfloat16):
        return "the Triton interpreter has no bfloat16/FP8 arithmetic"
    return None


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """x [..., K] times the block-scaled FP8 weight [N, K] -> [..., N] (see the module doc)."""
    x2 = x.reshape(-1, x.shape[-1])
    why_not = unsupported_reason(x2, weight, scale, block)
    if why_not is None and backend == "auto" and x2.shape[0] > SMALL_M:
        if can_use(x2, weight, block) and not reference_forced():
            check = None if verified() else fp8_block_linear_reference(x2, weight, scale, block)
            y = scaled_mm_block(x2, weight, scale, check)
            if y is not None:
                return (y if bias is None else y + bias).view(*x.shape[:-1], weight.shape[0])
        why_not = f"M = {x2.shape[0]} > {SMALL_M}: compute-bound, dequantize once"
    if resolve_backend(backend, (x2, weight, scale), why_not) == "torch":
        return fp8_block_linear_reference(x, weight, scale, block, bias)
    from chatfleet.engine.kernels.fp8_gemm_triton import fp8_block_linear_triton

    y = fp8_block_linear_triton(x2, weight, scale, block)
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])
