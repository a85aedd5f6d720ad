"""The calling convention the C++ chunk attention kernels share (``chunk_attention_amx``: bf16 on AMX
tiles; ``chunk_attention_avx512``: float32 with AVX-512): which operands they take and how they are
called, written once.

Each library exports ``int cf_chunk_attention_<name>(q, q_st, q_sh, k, k_sh, k_st, v, v_sh, v_st, out,
n, hq, hkv, d, start, scale, threads)``: q [n, Hq, D] (positions start..start+n-1) and k, v
[Hkv, start + n, D] (positions 0..start+n-1) as a pointer and two strides each (unit stride along
D), out [n, Hq, D] contiguous, in the kernel's one dtype; 0 on success, else a code.
"""

from __future__ import annotations

import ctypes
from _ctypes import CFuncPtr  # the type of a library's function (ctypes.CDLL attribute)
from collections.abc import Container

import torch

_CODES = {4: "could not allocate its scratch"}  # every other nonzero code: the shapes were refused


def bind(fn: CFuncPtr) -> None:
    """Set a chunk kernel entry point's ctypes signature."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64,  # q, k, v: pointer and two strides
                   ptr, i64, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]


def operands_fit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None,
                 key_start: int, dtype: torch.dtype, head_dims: Container[int]) -> bool:
    """Whether q, k, v are what a chunk kernel of ``dtype`` and ``head_dims`` takes: CPU tensors,
    keys from position 0, no sliding window, unit stride along D, whole GQA groups."""
    n, hq, d = q.shape
    hkv = k.shape[0]
    return (window is None and key_start == 0 and q.device.type == "cpu" and n > 0
            and all(t.dtype == dtype and t.dim() == 3 and t.stride(2) == 1 for t in (q, k, v))
            and d in head_dims and hkv > 0 and hq % hkv == 0
            and k.shape == v.shape == (hkv, start + n, d))


def run(fn: CFuncPtr, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
        what: str) -> torch.Tensor:
    """Call a bound chunk kernel on operands that fit it: [n, Hq, D] in q's dtype. ``what`` names the
    kernel in the error raised for a nonzero code."""
    n, hq, d = q.shape
    out = torch.empty(n, hq, d, dtype=q.dtype)
    rc = fn(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(),
            v.stride(0), v.stride(1), out.data_ptr(), n, hq, k.shape[0], d, start, scale, torch.get_num_threads())
    if rc:
        raise RuntimeError(f"{what} {_CODES.get(rc, 'refused the shapes')} (code {rc})")
    return out
