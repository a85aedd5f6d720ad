"""Grouped expert GEMM: rows grouped by expert, each group times its own expert's weight.

``grouped_gemm(x, offsets, weight, scale=None, block=None)``: x [R, K] with expert ``e``'s rows
at ``offsets[e] : offsets[e + 1]`` (``offsets`` [E + 1] int32, non-decreasing, ending at R);
``weight`` [E, N, K] in x's dtype, or e4m3 with block scales ``scale`` [E, ceil(N / bn),
ceil(K / bk)] for ``block = (bn, bk)``. Returns [R, N] in x's dtype: row r of group e is
``x[r] (W_e * S_e)^T``. One launch covers every expert (no Python loop over experts).

Reference: one ``F.linear`` per expert that received rows (FP8 weights dequantized by the
engine's ``dequantize_weight``), the loop ``moe.Experts`` runs today.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from chatfleet.engine.kernels.backend import interpreting, resolve_backend
from chatfleet.engine.models.fp8_format import FP8WeightFormat, ceil_div
from chatfleet.engine.models.fp8_linear import FP8, dequantize_weight


def expert_weight(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None, e: int,
                  dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s weight [N, K] in ``dtype`` (dequantized when it is FP8)."""
    if scale is None or block is None:
        return weight[e].to(dtype)
    return dequantize_weight(weight[e], scale[e], FP8WeightFormat("block", block), dtype)


def grouped_gemm_reference(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
                           scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for e in range(weight.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = F.linear(x[lo:hi], expert_weight(weight, scale, block, e, x.dtype))
    return out


def unsupported_reason(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                       block: tuple[int, int] | None) -> str | None:
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[2] or offsets.numel() != weight.shape[0] + 1:
        return "x must be [R, K], the weights [E, N, K] and the offsets [E + 1]"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"activations in {x.dtype}"
    if (scale is None) != (block is None):
        return "block scales need both scale and block"
    if scale is not None and block is not None:
        e, n, k = weight.shape
        if tuple(scale.shape) != (e, ceil_div(n, block[0]), ceil_div(k, block[1])):
            return f"scales {tuple(scale.shape)} do not tile the experts' weights in {block} blocks"
        if block[1] < 16 or block[1] & (block[1] - 1):
            return f"scale block width {block[1]} (needs a power of two >= 16)"
    elif weight.dtype != x.dtype:
        return f"{weight.dtype} weights without scales for {x.dtype} activations"
    if x.stride(1) != 1 or weight.stride(2) != 1:
        return "rows are not contiguous"
    if not x.is_cuda and interpreting() and (weight.dtype == FP8 or x.dtype == torch.bfloat16):
        return "the Triton interpreter has no bfloat16/FP8 arithmetic"
    return None


def grouped_gemm(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                 block: tuple[int, int] | None = None, backend: str = "auto") -> torch.Tensor:
    """[R, N]: every group of rows times its expert's weight (see the module doc)."""
    tensors = (x, offsets, weight) if scale is None else (x, offsets, weight, scale)
    if resolve_backend(backend, tensors, unsupported_reason(x, offsets, weight, scale, block)) == "torch":
        return grouped_gemm_reference(x, offsets, weight, scale, block)
    from chatfleet.engine.kernels.grouped_gemm_triton import grouped_gemm_triton

    return grouped_gemm_triton(x, offsets, weight, scale, block)
