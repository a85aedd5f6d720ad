"""Per-head RMSNorm then RoPE of a step's q and k heads, as one C++ pass on the CPU where it
builds (``qk_norm_rope_cpu.cpp``), else as torch ops.

Why hand-written: as torch ops it is five (``rms_norm`` over a strided view, the weight multiply,
``x * cos``, ``roll``, ``addcmul``), each a pass over memory, and ``rms_norm`` over rows of 64
values is slow per row: on an AMX Xeon, one thread, a 2,000-token chunk of ``small`` (8 q + 2 k
heads of 64) took ~5.7 ms per layer, ``rms_norm`` 3 ms of it, and the profile of a bf16 prefill
step (4 x 2,000 tokens) charged 19% of the step to RoPE and reshapes. The kernel reads each row
of the fused qkv projection once and rounds where the torch ops round (each op's result in the
model's dtype), so its output equals theirs to the last bit in almost every element (a sum of
squares in another order can move one rounding; the tests bound it).

Built like the paged decode kernel (``cpu_kernel_build``: system compiler at first use, cached
by source, compiler and CPU), but without ``-ffast-math`` and with contraction off, so
products and sums round as the torch ops' do. ``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from chatfleet.engine.models.cpu_kernel_build import KernelLoader

SOURCE = Path(__file__).with_name("qk_norm_rope_cpu.cpp")
FLAGS = ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
MAX_HEAD_DIM = 512
DTYPES = (torch.float32, torch.bfloat16)


def _bind(lib: ctypes.CDLL) -> str | None:
    fn = lib.cf_qk_norm_rope
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 3
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_int])
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "q/k norm + RoPE C++ kernel", "it runs as torch ops", _bind)


def available() -> bool:
    """Whether the kernel is built and loaded here (builds it on first call)."""
    return _LOADER.available()


def address(symbol: str) -> int | None:
    """Where this library's exported function ``symbol`` lies (``decode_stack.py`` hands it to C++
    code), or None where the library is not loaded here."""
    return _LOADER.address(symbol)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, folded_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over x [T, H, D] with cos/sin [T, 1, D] (sin
    sign-folded, see ``qwen3.Rotary``)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), folded_sin)


def rms_norm_then_scale(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Like transformers in every dtype: normalize (in float32 inside ``rms_norm`` for a 16-bit
    ``x``), round to ``x``'s dtype, then scale by ``weight`` (which broadcasts over ``x``'s
    trailing dims). Two ops, no explicit casts."""
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), None, eps).mul_(weight)


def qk_norm_rope_torch(qk: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """The torch-op path (and the kernel's reference): qk [T, H, D] -> [T, H, D]."""
    return apply_rope(rms_norm_then_scale(qk, weight, eps), cos, sin)


def _kernel_takes(qkv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  head_dim: int) -> bool:
    return (qkv.is_cpu and qkv.dtype in DTYPES and qkv.dim() == 2 and qkv.stride(1) == 1
            and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
            and all(t.dtype == qkv.dtype and t.is_contiguous() for t in (weight, cos, sin)))


def qk_norm_rope(qkv: torch.Tensor, heads: int, head_dim: int, weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The first ``heads * head_dim`` columns of qkv [T, >= heads * head_dim] as [T, heads, D],
    each head RMS-normed, scaled by ``weight`` [heads, D] and rotated by cos/sin [T, 1, D]."""
    tokens = qkv.shape[0]
    lib = _LOADER.load()
    if lib is None or not _kernel_takes(qkv, weight, cos, sin, head_dim) or cos.shape != (tokens, 1, head_dim):
        qk = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
        return qk_norm_rope_torch(qk, weight, cos, sin, eps)
    out = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype)
    rc = lib.cf_qk_norm_rope(qkv.data_ptr(), qkv.stride(0), tokens, heads, head_dim, weight.data_ptr(),
                             cos.data_ptr(), sin.data_ptr(), eps, out.data_ptr(),
                             int(qkv.dtype == torch.bfloat16), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"q/k norm + RoPE C++ kernel refused the shapes (code {rc})")
    return out
