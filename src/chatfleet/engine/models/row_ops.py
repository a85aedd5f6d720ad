"""The decoder layer's row-wise hidden-state ops, RMSNorm (alone, or after the residual add in the same
pass) and SwiGLU's ``silu(gate) * up``, as C++ passes on the CPU where they build
(``row_ops_cpu.cpp``), else as torch ops.

Why hand-written: as torch ops RMSNorm is a composite of ~8 passes over memory (upcast, ``pow``,
``sum``, ``div_``, ``add_``, ``rsqrt``, ``mul``, the rounding and the weight's ``mul``), and SwiGLU's
activation is two (``silu`` over the strided gate half, then ``mul_``). The profile of a bf16
prefill step (2,048 tokens of ``small``: hidden 512, intermediate 1,536, 8 layers) on an AMX
Xeon, one thread, charged 16.7 ms/step to the 17 RMSNorms and 13.7 ms to the 8 activations. Each
kernel here reads a row once and writes it once. Per call, one thread, 2,048 rows (torch ops ->
kernel): RMSNorm over 512, bf16 ~1.9-3.2 -> 0.45 ms, f32 1.1 -> 0.41 ms; over 3,072, bf16 18.5 ->
2.1 ms, f32 15.8 -> 2.1 ms; silu(gate) * up of a [2,048, 3,072] gate_up, bf16 2.4 -> 2.2 ms, f32
2.3 -> 1.5 ms (the activation is bound by exp's arithmetic, not memory). The whole step
(``benchmarks/profile_step.py``, same tree, kernels off -> on): bf16 prefill 148.0 -> 127.0 ms.

Both equal the torch ops to the last bit, because they do what those ops do (the tests check it
over shapes, scales, subnormals and specials, and every 16-bit gate): RMSNorm adds the squares in
the order of torch's CPU sum kernel (``cascade_sum``: 8 float lanes, also on AVX-512 CPUs, 4
accumulators, cascade levels) and rounds where the ops round; the activation computes ``exp`` by
Sleef's ``expf_u10`` algorithm (what torch's vectorized ``exp`` calls; within one ulp of the
correctly rounded exp, one ulp off for ~1% of float32 inputs over [-103, 88]) over each row's
whole vector steps, and by libm's ``expf`` over the row's tail, as torch's loop does. In bfloat16
the whole steps read the rounded activation from a table of all 65,536 gates, built once by that
same arithmetic (same bits without the division that bounded the loop: [500, 3,072] 0.64 ->
0.52 ms, one thread). Measured:
0 of 2,000,003 float32 gates over [-110, 110] (and 0 of 10,000 over every exponent) and 0 of the
65,536 bfloat16 gates differ from torch's ``silu`` by an ulp or more (one thread: with more,
torch's own result moves a scalar tail to wherever a thread's range ends, an ulp off there).

Built like the q/k norm + RoPE kernel (``cpu_kernel_build``: system compiler at first use, cached
by source, compiler and CPU; no ``-ffast-math``, contraction off), preferring
512-bit vectors (gcc's 256-bit default: the bf16 activation 3.8 ms instead of 2.9).
``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off; so do a GPU tensor, another dtype, a row that is not
contiguous, and autograd (a tensor that needs a gradient).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from chatfleet.engine.models.cpu_kernel_build import KernelLoader
from chatfleet.engine.models.qk_norm_rope import rms_norm_then_scale

SOURCE = Path(__file__).with_name("row_ops_cpu.cpp")
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-fast-math", "-ffp-contract=off", "-fopenmp",
         "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
DTYPES = (torch.float32, torch.bfloat16)


def _bind(lib: ctypes.CDLL) -> str | None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.cf_rms_norm.restype = ctypes.c_int
    lib.cf_rms_norm.argtypes = (ptr, i64, i64, i64, ptr, ctypes.c_float, ptr, i64, ctypes.c_int, ctypes.c_int)
    lib.cf_add_rms_norm.restype = ctypes.c_int
    lib.cf_add_rms_norm.argtypes = (ptr, ptr, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int, ctypes.c_int)
    lib.cf_silu_and_mul.restype = ctypes.c_int
    lib.cf_silu_and_mul.argtypes = (ptr, i64, i64, i64, ptr, ctypes.c_int, i64, ctypes.c_int)
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "row-wise (RMSNorm, SwiGLU) C++ kernels", "they run as torch ops",
                       _bind)


def available() -> bool:
    """Whether the kernels are built and loaded here (builds them on first call)."""
    return _LOADER.available()


def address(symbol: str) -> int | None:
    """Where this library's exported function ``symbol`` lies (``decode_stack.py`` hands it to C++
    code), or None where the library is not loaded here."""
    return _LOADER.address(symbol)


@functools.cache
def vector_lanes() -> int:
    """float32 lanes of torch's CPU vectors here (``silu``'s vectorized loop steps by two): 16
    with AVX-512, else 8."""
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def silu_step(dtype: torch.dtype) -> int:
    """Values per step of torch's vectorized ``silu`` loop (two vectors of ``dtype``): the whole
    steps ``cf_silu_and_mul`` computes as that loop does, the rest as its scalar tail."""
    return vector_lanes() * (4 if dtype == torch.bfloat16 else 2)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch-op path (and the kernel's reference), like transformers: float32 in one
    ``rms_norm``; 16 bits normalized in float32, rounded, then scaled by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return rms_norm_then_scale(x, weight, eps)


def silu_and_mul_torch(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """The torch-op path (and the kernel's reference): ``silu(gate) * up`` of gate_up [..., 2I]."""
    gate, up = gate_up.split(intermediate, dim=-1)
    return F.silu(gate).mul_(up)


def _takes(*tensors: torch.Tensor) -> bool:
    x = tensors[0]
    dtype = x.dtype
    return (x.is_cpu and dtype in DTYPES and all(t.dtype == dtype for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """x as [rows, n] with contiguous rows, and its row stride; None where its rows are not
    evenly strided."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x, x.stride(0)
    if x.dim() >= 1 and x.is_contiguous():
        flat = x.view(-1, x.shape[-1])
        return flat, x.shape[-1]
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [..., n], scaled by weight [n]: ``rms_norm_torch``'s result."""
    lib = _LOADER.load()
    rows = _rows(x) if lib is not None and _takes(x, weight) else None
    n = x.shape[-1]
    if lib is None or rows is None or n == 0 or weight.shape != (n,) or not weight.is_contiguous():
        return rms_norm_torch(x, weight, eps)
    flat, stride = rows
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.cf_rms_norm(flat.data_ptr(), stride, flat.shape[0], n, weight.data_ptr(), eps, out.data_ptr(), n,
                         int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"RMSNorm C++ kernel refused the shapes (code {rc})")
    return out


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The fallback: ``x += residual`` in place as a torch op, then ``rms_norm`` (the tests check the
    kernel against ``add_`` and ``rms_norm_torch``)."""
    return rms_norm(x.add_(residual), weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A decoder layer's residual add and the RMSNorm after it, in one pass: ``x += residual``
    (in place: x becomes the residual stream), then the RMSNorm of x scaled by weight [n]; the
    same bits as ``add_rms_norm_torch``."""
    lib = _LOADER.load()
    n = x.shape[-1]
    if (lib is None or not _takes(x, residual, weight) or x.shape != residual.shape or not x.is_contiguous()
            or not residual.is_contiguous() or weight.shape != (n,) or not weight.is_contiguous() or n == 0):
        return add_rms_norm_torch(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    rc = lib.cf_add_rms_norm(x.data_ptr(), residual.data_ptr(), x.numel() // n, n, weight.data_ptr(), eps,
                             out.data_ptr(), int(x.dtype == torch.bfloat16), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"add + RMSNorm C++ kernel refused the shapes (code {rc})")
    return out


def silu_and_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``silu(gate) * up`` of gate_up [T, 2 * intermediate] (gate then up): [T, intermediate],
    ``silu_and_mul_torch``'s result."""
    lib = _LOADER.load()
    if (lib is None or not _takes(gate_up) or gate_up.dim() != 2 or gate_up.stride(1) != 1 or intermediate < 1
            or gate_up.shape[1] != 2 * intermediate):
        return silu_and_mul_torch(gate_up, intermediate)
    tokens = gate_up.shape[0]
    out = torch.empty(tokens, intermediate, dtype=gate_up.dtype)
    bf16 = gate_up.dtype == torch.bfloat16
    rc = lib.cf_silu_and_mul(gate_up.data_ptr(), gate_up.stride(0), tokens, intermediate, out.data_ptr(), int(bf16),
                             silu_step(gate_up.dtype), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"SwiGLU C++ kernel refused the shapes (code {rc})")
    return out
