"""The chunk kernels' shared calling convention: which operands fit, and what a kernel's nonzero code
raises (runs on any CPU: no kernel library needed)."""

from __future__ import annotations

import ctypes
import re

import pytest
import torch

from chatfleet.engine.models import chunk_kernel_abi as abi

DIMS = range(16, 257, 16)


def _operands(dtype: torch.dtype, n: int = 10, start: int = 6, d: int = 64):
    return torch.zeros(n, 8, d, dtype=dtype), torch.zeros(2, start + n, d, dtype=dtype), \
        torch.zeros(2, start + n, d, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_operands_the_kernels_take(dtype):
    q, k, v = _operands(dtype)
    assert abi.operands_fit(q, k, v, 6, None, 0, dtype, DIMS)
    kv_rows = torch.zeros(16, 2, 64, dtype=dtype)  # [T, Hkv, D] rows seen as [Hkv, T, D]: strided, unit along D
    assert abi.operands_fit(q, kv_rows.transpose(0, 1), kv_rows.transpose(0, 1), 6, None, 0, dtype, DIMS)


def test_operands_the_kernels_refuse():
    q, k, v = _operands(torch.float32)
    assert not abi.operands_fit(q, k, v, 6, 16, 0, torch.float32, DIMS)  # a sliding window
    assert not abi.operands_fit(q, k[:, 2:], v[:, 2:], 6, None, 2, torch.float32, DIMS)  # keys not from 0
    assert not abi.operands_fit(q, k, v, 6, None, 0, torch.bfloat16, DIMS)  # another dtype
    assert not abi.operands_fit(q, k, v, 5, None, 0, torch.float32, DIMS)  # k/v not start + n long
    assert not abi.operands_fit(q, k, v[:, :-1], 6, None, 0, torch.float32, DIMS)  # k and v differ
    assert not abi.operands_fit(q[:, :7], k, v, 6, None, 0, torch.float32, DIMS)  # 7 heads over 2 kv heads
    q40, k40, v40 = _operands(torch.float32, d=40)
    assert not abi.operands_fit(q40, k40, v40, 6, None, 0, torch.float32, DIMS)  # head dim not taken
    qt = torch.zeros(10, 64, 8).transpose(1, 2)
    assert not abi.operands_fit(qt, k, v, 6, None, 0, torch.float32, DIMS)  # q not unit stride along D
    assert not abi.operands_fit(q[:0], k[:, :6], v[:, :6], 6, None, 0, torch.float32, DIMS)  # no query


_PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_int64, ctypes.c_float, ctypes.c_int)


@pytest.mark.parametrize("code,says", [(3, "refused the shapes (code 3)"), (4, "could not allocate its scratch")])
def test_a_nonzero_code_raises_naming_the_kernel_and_the_reason(code, says):
    fn = _PROTOTYPE(lambda *args: code)
    q, k, v = _operands(torch.float32)
    with pytest.raises(RuntimeError, match=re.escape(f"the test kernel {says}")):
        abi.run(fn, q, k, v, 6, 0.125, "the test kernel")


def test_the_call_passes_shapes_and_strides_in_order():
    seen = []

    def record(*args):
        seen.append(args)
        return 0

    fn = _PROTOTYPE(record)
    q, k, v = _operands(torch.float32)
    out = abi.run(fn, q, k, v, 6, 0.125, "the test kernel")
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    a = seen[0]
    assert (a[1], a[2], a[4], a[5], a[7], a[8]) == (q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                                   v.stride(0), v.stride(1))
    assert (a[10], a[11], a[12], a[13], a[14], a[15]) == (10, 8, 2, 64, 6, 0.125)
    assert a[9] == out.data_ptr() and a[16] == torch.get_num_threads()
