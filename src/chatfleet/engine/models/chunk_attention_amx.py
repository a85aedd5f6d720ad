"""Causal attention of a bf16 prompt chunk with Intel AMX tiles, in one C++ pass per group of
tiles of 16 query rows (``chunk_attention_amx.cpp``), where the CPU has AMX.

Why hand-written: the ``onednn`` path (``prefill_attention``) runs each block of query rows as two
oneDNN products with the scores materialized between them, and in bf16 the scores' round trips
cost more than the products: on an AMX Xeon, one thread, the profile of a bf16 prefill step of
``small`` (2,048 tokens, 261 ms) charged the products 66 ms, ``softmax`` 44 ms and the bf16 <->
float32 casts of the scores 39 ms. PyTorch's fused SDPA kernel is faster on AMX but does not give
the same bits when a prompt is cut into other chunks (it tiles keys relative to the chunk), which
the engine's greedy-equivalence guarantees need. Here every query row's result depends only on
its own query and on the keys taken in fixed blocks from position 0, so chunking never changes a
bit; softmax runs with one AVX-512 vector per key, and both products run on AMX tiles. Up to 8
tiles share a pass over the keys in blocks (online softmax), so that a long context's K and
V are read once per 128 query rows rather than once per 16: one thread, 8 x 64 heads over 2 kv,
the old and the new build interleaved in one process, 500 new tokens over 5,500 cached 21.2 ->
16.9 ms a layer, 200 over 5,800 8.2 -> 6.8 ms; prompts of 500 and 2,000 from position 0 the same.
V^T is laid out in pieces of 32 keys ([d][32] each), so that each AMX tile of it is one
contiguous 1 KiB read instead of 16 rows a context apart, and the block's maxima and sums run in
4 chains each: the same measurement, 0.86 -> 0.71 ms for 500 tokens from position 0, 14.7 ->
13.9 ms for 500 over 5,500, 5.9 -> 5.5 ms for 200 over 5,800. Then key blocks of 128 instead of
512 (a block's K and V^T stay in L1 while the group's tiles take it in turn) and 2^x by a
polynomial of degree 4 instead of 5: 0.71 -> 0.57, 12.9 -> 10.9, 5.5 -> 4.8 ms (blocks of 64, 96
and 256 and groups of 4 and 16 tiles measured slower); then 2^x from x - floor(x) in one
instruction (vreduceps) and a degree-4 fit on [0, 1]: 3-5% less again.

Takes bf16 q [n, Hq, D], k, v [Hkv, start + n, D] (keys from position 0, no sliding window), D a
multiple of 16 up to 256, unit stride along D. Built like the other CPU kernels
(``cpu_kernel_build``) and only on a CPU whose flags name ``amx_bf16``;
``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from chatfleet.engine.models import chunk_kernel_abi as abi
from chatfleet.engine.models.cpu_kernel_build import KernelLoader
from chatfleet.engine.models.dtype import cpu_flags

SOURCE = Path(__file__).with_name("chunk_attention_amx.cpp")
FLAGS = ("-O3", "-march=native", "-fno-fast-math", "-ffp-contract=off", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
MAX_HEAD_DIM = 256
HEAD_DIMS = range(16, MAX_HEAD_DIM + 1, 16)  # multiples of 16


def cpu_has_amx() -> bool:
    """Whether this CPU's flags (``/proc/cpuinfo``) name AMX tiles with bf16."""
    flags = cpu_flags()
    return "amx_bf16" in flags and "amx_tile" in flags and "avx512_bf16" in flags


def _bind(lib: ctypes.CDLL) -> str | None:
    """The kernel's signatures, after ``cf_amx_init`` asks the OS for AMX tile state."""
    lib.cf_amx_init.restype = ctypes.c_int
    rc = lib.cf_amx_init()
    if rc:
        return "built without AMX" if rc == 1 else "the OS refused AMX tile state"
    abi.bind(lib.cf_chunk_attention_amx)
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "AMX chunk attention kernel",
                       "prompt chunks take the oneDNN blocks", _bind, needs=cpu_has_amx)


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
    return abi.operands_fit(q, k, v, start, window, key_start, torch.bfloat16, HEAD_DIMS) and available()


def chunk_attention_amx(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                        scale: float) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] (positions start..start+n-1) over k, v [Hkv, start+n, D]
    (positions 0..start+n-1): [n, Hq, D] bf16. Call only where ``takes`` holds."""
    lib = _LOADER.load()
    assert lib is not None
    return abi.run(lib.cf_chunk_attention_amx, q, k, v, start, scale, "AMX chunk attention kernel")
