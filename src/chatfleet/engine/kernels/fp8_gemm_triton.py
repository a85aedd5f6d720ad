"""Triton block-scaled FP8 GEMM (see ``fp8_gemm.py``): one program per [BLOCK_M, BLOCK_N] output
tile, stepping over K in ``BLOCK_K``-wide slices inside one scale column; the [BLOCK_N] scales
of each slice (row ``n // bn`` of the scale grid) multiply its float32 partial product.

The weight is read in whatever dtype it is stored (e4m3 on a GPU; the tests pass its exact
values as float16/float32 under the interpreter, which has no FP8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from chatfleet.engine.kernels.paged_decode_triton import precision


@triton.jit
def _fp8_block_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    scale_rows = s_ptr + (rn // SCALE_N).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_wn + (k0 + rk)[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(x.dtype)
        s = tl.load(scale_rows + k0 // SCALE_K, mask=n_ok, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION) * s[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def tile_config(m: int, block_k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the fewest padded rows for M = 1..64, narrow N tiles so a
    GEMV still spreads over every multiprocessor, K slices inside one scale column."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    return block_m, 32 if m <= 16 else 64, min(block_k, 128)


def fp8_block_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            block: tuple[int, int]) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k = tile_config(m, block[1])
    scale = scale.float().contiguous()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        x, weight, scale, y, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision(x.dtype),
    )
    return y
