"""Linears of a few rows (decode steps) in one small C++ kernel (``packed_gemv_cpu.cpp``) that reads
oneDNN's own prepacked weight: no second copy of any weight.

Why hand-written: at one row a linear only has to stream its weight once, but oneDNN's prepacked
product (``mkldnn::_linear_pointwise``) reached 10-15 GB/s on ``small``'s weights where one thread
reads 24-30 GB/s (AMD EPYC Zen 4, bf16, one thread, a decode step's 33 products in layer order:
4.2 ms where the bytes take ~2.3), and ~93% of a one-stream bf16 decode step was those calls.
The kernel walks each block of outputs as one sequential stream with every row's sums in
registers.

The layout. ``torch.ops.mkldnn._reorder_linear_weight`` of an [N, K] weight, on the CPUs measured
(AVX-512, float32 and bfloat16), is ceil(N / 64) blocks of 64 outputs, each holding, for every k
step up to K rounded up (to 32 in bf16, 16 in float32), the 64 outputs' weights, bf16 as (k, k+1)
pairs: the operand layout of vdpbf16ps. oneDNN picks its format per CPU and version, so nothing
here assumes it: ``packed_layout`` reads the packed bytes (``torch.ops.mkldnn.data_ptr``) and
compares them with that layout built from the plain weight, for block widths 64, 32 and 16; only a
weight that matches byte for byte takes the kernel, any other stays with oneDNN at every row count.

Rows: up to ``MAX_ROWS`` (decode batches), above it oneDNN's blocked GEMM. One row's sums fit in
registers four rows at a time; with more rows a block is read in 8 KiB chunks: the first group of
four streams a chunk from memory, the others read it again from L1, and every group prefetches its
share of the next chunk into L2, so the weight is read once at any row count and the memory stream
overlaps the multiply-adds. Measured on Zen 4, one thread, ``small``'s products in layer order (the
lm head's too), against oneDNN's: 0.6x its time at 1-8 rows, 0.7x-0.86x at 16, 0.9x-0.97x at 32,
0.94x-1.1x at 48-64: hence 32 (``row_buckets.EXACT_UP_TO`` too). Sums are float32 in k order (bf16
pairs as vdpbf16ps sums them where the CPU has AVX512_BF16, else widened and fused-multiply-added),
the bias added, the output rounded once; the sums are the ones oneDNN's own product gives these
rows (checked: equal bits on every ``tiny`` shape and on ``small``'s up to K = 512; at K = 1,536
oneDNN splits K and gives a row alone and among 40 rows different bits itself), so there a row's
result does not depend on how many rows the step has. A bf16 MLP's gate takes oneDNN's swish
(its eltwise code, operation for operation: the same bits as the post-op) and its up half a factor,
the activated gate, as oneDNN's binary ``mul`` post-op does (``swiglu.py``).

On an AMX CPU (Intel Xeon, ``amx_bf16``) bf16 sums run on AMX tiles instead, at every row count:
a packed bf16 block (32 outputs wide there) is AMX's B operand as it lies, 16 rows go to a tile
and one tile product takes 32 k values of 16 outputs. There oneDNN's own bf16 product is an AMX
one, and a k pair's two products round on the tiles as in oneDNN's and not as in vdpbf16ps: the
tiles give oneDNN's bits at every row count up to 33 on every shape tried (``small``'s included,
where the AVX-512 sums differed from 4-8 rows on), and each row's bits are its own. Measured on an
AMX Xeon, one thread, ``small``'s [3072, 1024] and [1024, 3072]: 0.24-0.29 ms at 1, 8 and 32 rows
(~25 GB/s: the weight's read) against 0.24 / 0.49 / 1.8 ms on AVX-512 (``use_amx`` switches, for
A/B runs) and 0.27-0.32 ms for oneDNN's. (At 38+ rows oneDNN's AMX product splits K from K = 512:
a prompt step's rows get other bits than decode rows there, as on Zen 4 at K = 1,536.)

Up to 128 rows (``MAX_ROWS``), not 32: a step of decodes beside returning turns' new tokens has
40-128 rows (at ``capacity.py``'s ``all`` knee three in four steps that carried a prompt chunk had
more than 64), and the decode stack runs such steps in one C++ call (``decode_stack.py``) only where
the modules would call these kernels for every linear. Measured on an AMX Xeon, ``small``'s
products in layer order (weights evicted between passes), the kernel's time over oneDNN's prepacked
product: bf16 one thread 0.82x-0.85x at 16-32 rows, 0.97x-1.01x at 40-64, 1.06x / 1.08x at 96 /
128 (1.20x / 1.25x at 192 / 256: there oneDNN's GEMM pulls ahead), two threads 0.93x-0.97x at 40-64;
float32 one thread 0.84x-0.91x at 16-64, 0.99x / 1.07x at 96 / 128. The stack's Python saved (~5 ms
a returning-turn step) outweighs the few tenths of a millisecond lost at 96-128 rows. Each row's bits
stay its own up to 128 rows (oneDNN's split K at 38+ rows gave rows other bits with other rows
beside them).

Built like the other CPU kernels (``cpu_kernel_build``): system compiler at first use, cached by
source, compiler and CPU, loaded with ctypes; only where the CPU has AVX-512 (F, BW).
``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from chatfleet.engine.models.cpu_kernel_build import KernelLoader
from chatfleet.engine.models.dtype import cpu_flags

SOURCE = Path(__file__).with_name("packed_gemv_cpu.cpp")
FLAGS = ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
DTYPES = (torch.float32, torch.bfloat16)
BLOCK_WIDTHS = (64, 32, 16)  # outputs per packed block, the widths the kernel has code for
KERNEL_MAX_ROWS = 128  # rows the kernel takes in one call (MAX_ROWS in packed_gemv_cpu.cpp)
MAX_ROWS = KERNEL_MAX_ROWS  # rows that take the kernel (more: oneDNN; see the docstring)
ONEDNN_SAME_BITS_ROWS = 32  # up to here oneDNN's own product gives these rows the kernel's bits (K <= 512)


def cpu_has_avx512() -> bool:
    """Whether this CPU's flags name what the kernel's vectors need (AVX-512 F, and BW for its
    16-bit loads, stores and bf16 rounding)."""
    flags = cpu_flags()
    return all(f in flags for f in ("avx512f", "avx512bw"))


def _bind(lib: ctypes.CDLL) -> str | None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.cf_packed_linear.restype = cint
    lib.cf_packed_linear.argtypes = (ptr, i64, i64, ptr, i64, i64, i64, i64, ptr, cint, ptr, i64, ptr, i64, cint, cint)
    lib.cf_packed_amx_init.restype = cint
    lib.cf_packed_use_amx.restype = cint
    lib.cf_packed_use_amx.argtypes = (cint,)
    lib.cf_packed_amx_init()  # bf16 sums on AMX tiles where the CPU has them and the OS grants them
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "packed-weight decode linear kernel",
                       "every linear runs in oneDNN", _bind, needs=cpu_has_avx512)


def available() -> bool:
    """Whether the kernel is built and loaded here (builds it on first call)."""
    return _LOADER.available()


def amx_in_use() -> bool:
    """Whether bf16 sums run on AMX tiles here (the CPU has AMX, the OS granted its tile state and
    ``use_amx`` did not switch it off); else on AVX-512."""
    lib = _LOADER.load()
    return lib is not None and lib.cf_packed_use_amx(-1) == 1


def use_amx(on: bool) -> bool:
    """Switch bf16 sums to AMX tiles (where granted) or to AVX-512, for paired A/B measurements and
    tests (the two give different bits: see the docstring); returns whether AMX is now in use."""
    lib = _LOADER.load()
    return lib is not None and lib.cf_packed_use_amx(int(on)) == 1


def address(symbol: str) -> int | None:
    """Where this library's exported function ``symbol`` lies (``decode_stack.py`` hands it to C++
    code), or None where the library is not loaded here."""
    return _LOADER.address(symbol)


@dataclass(frozen=True)
class PackedLayout:
    """Where a prepacked [n, k] weight's values lie: blocks of ``block_n`` outputs, each
    ``k_padded`` k steps long, bf16 as (k, k+1) pairs."""

    n: int
    k: int
    k_padded: int
    block_n: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.block_n not in BLOCK_WIDTHS or self.k_padded < self.k or self.n <= 0 or self.k <= 0:
            raise ValueError(f"not a packed layout the kernel reads: {self}")
        if self.dtype not in DTYPES or (self.dtype == torch.bfloat16 and self.k_padded % 2):
            raise ValueError(f"not a packed layout the kernel reads: {self}")

    @property
    def values(self) -> int:
        """Values the packed buffer holds (padding included)."""
        return -(-self.n // self.block_n) * self.block_n * self.k_padded


def lay_out(weight: torch.Tensor, layout: PackedLayout) -> torch.Tensor:
    """``weight`` [n, k] in ``layout``'s order, flat (the kernel's reading of the packed bytes)."""
    pair = 2 if layout.dtype == torch.bfloat16 else 1
    blocks = -(-layout.n // layout.block_n)
    padded = weight.new_zeros(blocks * layout.block_n, layout.k_padded)
    padded[: layout.n, : layout.k] = weight
    grouped = padded.view(blocks, layout.block_n, layout.k_padded // pair, pair)
    return grouped.permute(0, 2, 1, 3).contiguous().view(-1)


def packed_bytes(packed: torch.Tensor) -> torch.Tensor:
    """A oneDNN-packed tensor's buffer, viewed (not copied) as flat values of its dtype."""
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    buf = (ctypes.c_char * nbytes).from_address(int(torch.ops.mkldnn.data_ptr(packed)))
    return torch.frombuffer(buf, dtype=packed.dtype)


def packed_layout(packed: torch.Tensor, weight: torch.Tensor) -> PackedLayout | None:
    """The layout of ``packed`` (``_reorder_linear_weight(weight)``) if it is one the kernel reads
    and the packed values equal ``weight`` laid out so, byte for byte; else None."""
    if (not packed.is_mkldnn or weight.dtype not in DTYPES or packed.dtype != weight.dtype or weight.dim() != 2
            or not cpu_has_avx512()):
        return None
    n, k = weight.shape
    try:  # the buffer accessors torch keeps for AOTInductor's oneDNN weights
        raw = packed_bytes(packed)
    except (AttributeError, RuntimeError):
        return None
    for block_n in BLOCK_WIDTHS:
        rows = -(-n // block_n) * block_n
        if raw.numel() % rows:
            continue
        try:
            layout = PackedLayout(n, k, raw.numel() // rows, block_n, weight.dtype)
        except ValueError:
            continue
        if _matches(raw, weight.detach(), layout):
            return layout
    return None


def _matches(raw: torch.Tensor, weight: torch.Tensor, layout: PackedLayout, rows_at_once: int = 1024) -> bool:
    """Whether ``raw`` holds ``weight`` in ``layout``, bit for bit (compared ``rows_at_once`` output
    rows at a time, so that a large weight, e.g. an LM head, needs no full second copy)."""
    bits = torch.int16 if layout.dtype == torch.bfloat16 else torch.int32
    step = max(1, rows_at_once // layout.block_n) * layout.block_n
    for first in range(0, layout.n, step):
        part = weight[first : first + step]
        sub = PackedLayout(part.shape[0], layout.k, layout.k_padded, layout.block_n, layout.dtype)
        want = lay_out(part, sub)
        got = raw[first * layout.k_padded : first * layout.k_padded + want.numel()]
        if not torch.equal(want.view(bits), got.view(bits)):
            return False
    return True


def runs(x: torch.Tensor, layout: PackedLayout | None) -> bool:
    """Whether ``x`` [rows, k] takes the kernel with a weight of ``layout``."""
    return (layout is not None and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype == layout.dtype
            and x.device.type == "cpu" and x.stride(-1) == 1 and not x.requires_grad and _LOADER.load() is not None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, layout: PackedLayout, bias: torch.Tensor | None = None,
                  mul: torch.Tensor | None = None, swish: bool = False) -> torch.Tensor:
    """``swish?(x W^T + bias) * mul`` (bias, swish and mul optional) for x [rows, k] (``runs(x,
    layout)``), W as ``packed`` holds it and mul [rows, n] of x's dtype, rows contiguous (SwiGLU's
    activated gate); ``swish``: oneDNN's swish post-op, the same bits (SwiGLU's gate)."""
    lib = _LOADER.load()
    assert lib is not None
    rows = x.shape[0]
    out = x.new_empty(rows, layout.n)
    if bias is not None:
        bias = bias.detach().to(layout.dtype).contiguous()
    if mul is not None and (mul.shape != (rows, layout.n) or mul.dtype != layout.dtype or mul.stride(-1) != 1):
        raise ValueError(f"mul must be [{rows}, {layout.n}] {layout.dtype} with contiguous rows, got "
                         f"{tuple(mul.shape)} {mul.dtype}")
    rc = lib.cf_packed_linear(x.data_ptr(), rows, x.stride(0), torch.ops.mkldnn.data_ptr(packed), layout.n,
                              layout.k, layout.k_padded, layout.block_n,
                              bias.data_ptr() if bias is not None else None, int(swish),
                              mul.data_ptr() if mul is not None else None, mul.stride(0) if mul is not None else 0,
                              out.data_ptr(), out.stride(0), int(layout.dtype == torch.bfloat16),
                              torch.get_num_threads())
    if rc:
        raise RuntimeError(f"packed linear C++ kernel refused the shapes (code {rc})")
    return out
