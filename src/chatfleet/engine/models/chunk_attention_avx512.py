"""Causal attention of a float32 or bf16 prompt chunk with AVX-512, in one C++ pass per
tile of 32 query rows (``chunk_attention_avx512.cpp``), where the CPU has AVX-512.

Why hand-written: the ``onednn`` path (``prefill_attention``) runs each block of query rows as two
oneDNN products with the scores materialized between them and ``softmax`` over them. On an Intel
Xeon without AMX (family 6 model 207, AVX-512, one thread) a 2,000-token float32 prefill of
``small`` took ~1,150 ms, of which the linears (at the machine's float32 peak, 155 GFLOP/s) ~650 ms
and attention ~440 ms: the products ~330 ms (about half the peak) and ``softmax`` ~107 ms. Here the
scores of a 32-row tile stay in L2 (128 bytes per key), both products run as fused multiply-adds
with one operand broadcast, and softmax runs with one vector per key for 16 rows. At a chat's
5,000-plus tokens attention is about half of a prefill's work, so this is where a long prompt's
time goes. PyTorch's fused SDPA kernel does not give the same bits when a prompt is cut into other
chunks; here every query row's result depends only on its own query and on its keys in order from
position 0, so chunking never changes a bit (as ``chunk_attention_amx`` for bf16).

bf16 chunks where there is no AMX kernel (an AVX-512 CPU without AMX: AMD Zen 4 and 5, Xeons before
Sapphire Rapids) come here too. They used to take the oneDNN blocks in bf16, and each chunk's new
shape made oneDNN JIT-compile its products (and evict the row buckets' linears from its primitive
cache). With AVX512_BF16 they run ``cf_chunk_attention_avx512_bf16``: the same plan with vdpbf16ps
(pairs of bf16 multiplied exactly, summed in float32), V paired by key once per call, the softmax
numerators rounded to bf16 for the second product (as the AMX kernel's), the result rounded once.
Without it they are widened to float32 (exactly) for the float32 kernel and rounded once. On an AMD
EPYC (Zen 4, family 25 model 17, AVX-512 with AVX512_BF16, one thread; niced, beside other work),
the attention of eight returning turns (40-120 new tokens over 300-1,200 cached) took 129 ms at new
shapes and 32 ms at seen ones through the bf16 blocks, 13-16 ms widened, 7-12 ms with pair dots;
eight 2,048-token cold chunks 508-634 ms through the blocks, 397-485 ms widened, 208-216 ms with
pair dots.

Takes q [n, Hq, D] and k, v [Hkv, start + n, D] of one dtype, float32 or bf16 (keys from position 0,
no sliding window), D in HEAD_DIMS, unit stride along D. Built like the other CPU kernels
(``cpu_kernel_build.KernelLoader``) and only on a CPU whose flags name ``avx512f``;
``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from chatfleet.engine.models import chunk_kernel_abi as abi
from chatfleet.engine.models.cpu_kernel_build import KernelLoader
from chatfleet.engine.models.dtype import cpu_flags

SOURCE = Path(__file__).with_name("chunk_attention_avx512.cpp")
FLAGS = ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
HEAD_DIMS = (16, 32, 48, 64, 80, 96, 112, 128, 192, 256)  # the ones compiled with D fixed
DTYPES = (torch.float32, torch.bfloat16)  # bf16: pair dot products where built, else widened to float32


def cpu_has_avx512() -> bool:
    """Whether this CPU's flags (``/proc/cpuinfo``) name AVX-512 Foundation."""
    return "avx512f" in cpu_flags()


def _bind(lib: ctypes.CDLL) -> str | None:
    """The kernel's signature, after checking the build targeted AVX-512."""
    lib.cf_avx512_built.restype = ctypes.c_int
    if lib.cf_avx512_built():
        return "built without AVX-512"
    abi.bind(lib.cf_chunk_attention_avx512)
    lib.cf_avx512_bf16_built.restype = ctypes.c_int
    abi.bind(lib.cf_chunk_attention_avx512_bf16)
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "AVX-512 chunk attention kernel",
                       "prompt chunks take the oneDNN blocks", _bind, needs=cpu_has_avx512)


def available() -> bool:
    """Whether the kernel is built and loaded here (builds it on first call)."""
    return _LOADER.available()


def address(symbol: str) -> int | None:
    """Where this library's exported function ``symbol`` lies (``decode_stack.py`` hands it to C++
    code), or None where the library is not loaded here."""
    return _LOADER.address(symbol)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, window: int | None,
          key_start: int) -> bool:
    """Whether these operands fit the kernel (and it is available)."""
    return (any(abi.operands_fit(q, k, v, start, window, key_start, dtype, HEAD_DIMS) for dtype in DTYPES)
            and available())


@functools.cache  # asked per chunk and layer; the build's answer does not change
def has_pair_dots() -> bool:
    """Whether bf16 chunks run with AVX512_BF16's pair dot products here (else widened to float32)."""
    lib = _LOADER.load()
    return lib is not None and lib.cf_avx512_bf16_built() == 0


def chunk_attention_avx512(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                           scale: float, pair_dots: bool | None = None) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] (positions start..start+n-1) over k, v [Hkv, start+n, D]
    (positions 0..start+n-1): [n, Hq, D] in q's dtype. Call only where ``takes`` holds.

    ``pair_dots`` (bf16 only): True runs the pair dot products (where ``has_pair_dots``), False
    widens to float32, None picks the first where it is built."""
    lib = _LOADER.load()
    assert lib is not None
    if q.dtype == torch.bfloat16 and (has_pair_dots() if pair_dots is None else pair_dots):
        # V is read once, into key pairs, so only K gets the compact copy (below)
        return abi.run(lib.cf_chunk_attention_avx512_bf16, q, k.contiguous(), v, start, scale,
                       "AVX-512 bf16 chunk attention kernel")
    # Keys and values as the engine passes them are views of wider rows (k: of the q|k heads, v: of
    # q|k|v), one 256-byte row every 2.5-3 KB: a compact copy (0.2 ms for 2,000 tokens) makes pass 1
    # and 2 read each head's keys from L2 in order, 47 -> 32 ms for 2,000 tokens here. For bf16 that
    # copy is the widening.
    out = abi.run(lib.cf_chunk_attention_avx512, q.float(), _compact_float32(k), _compact_float32(v), start,
                  scale, "AVX-512 chunk attention kernel")
    return out.to(q.dtype)


def _compact_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous float32 tensor, in one pass (itself where it already is one)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)
