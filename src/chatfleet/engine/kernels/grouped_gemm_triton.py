"""Triton grouped expert GEMM (see ``grouped_gemm.py``).

The grid is (expert, row tile, column tile) with as many row tiles as the busiest expert
needs; a program whose tile starts past its expert's rows returns at once. Each program steps
over K in slices inside one scale column, as the FP8 GEMM does; without scales the weight is
read in x's dtype and no scale is applied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatfleet.engine.kernels.fp8_gemm_triton import tile_config
from chatfleet.engine.kernels.paged_decode_triton import precision


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, offsets_ptr, w_ptr, s_ptr, y_ptr, N, K,
    stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_ym,
    HAS_SCALE: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    expert = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    lo = tl.load(offsets_ptr + expert)
    hi = tl.load(offsets_ptr + expert + 1)
    row0 = lo + pid_m * BLOCK_M
    if row0 >= hi:
        return
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < hi
    n_ok = rn < N
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn
    scale_rows = s_ptr + expert.to(tl.int64) * stride_se + (rn // SCALE_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
        part = tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if HAS_SCALE:
            part = part * tl.load(scale_rows + k0 // SCALE_K, mask=n_ok, other=0.0)[None, :]
        acc += part
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def grouped_gemm_triton(x: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor,
                        scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    rows, k = x.shape
    num_experts, n, _ = weight.shape
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    busiest = int((offsets[1:] - offsets[:-1]).max())  # one host sync: sizes the grid
    block_m, block_n, block_k = tile_config(busiest, block[1] if block is not None else 128)
    if scale is not None and block is not None:
        scale = scale.float().contiguous()
        s_args = (scale, scale.stride(0), scale.stride(1), block[0], block[1])
    else:
        block_k = min(block_k, 64)
        s_args = (x, 0, 0, 1, block_k)  # unused
    s_ptr, stride_se, stride_sn, scale_n, scale_k = s_args
    grid = (num_experts, triton.cdiv(busiest, block_m), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x, offsets, weight, s_ptr, y, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), stride_se, stride_sn, y.stride(0),
        HAS_SCALE=scale is not None, SCALE_N=scale_n, SCALE_K=scale_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision(x.dtype),
    )
    return y
