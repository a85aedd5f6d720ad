"""Paged decode attention on the CPU in one small C++ kernel (``paged_decode_cpu.cpp``), with its
torch reference.

Why hand-written: the torch-op path (``decode_attention.py``) gathers every sequence's K blocks into
a padded copy (``index_select``), multiplies (``bmm``), softmaxes, and sums V rows with
``embedding_bag``: K is read twice and written once, scores go through memory in 16 bits, and a
batch of 32 x 500-token decodes spends ~45% of a decode step there (issue 20's profile). Fused SDPA
kernels need K/V contiguous per sequence, so they would need the same gather. The kernel reads each
sequence's K and V rows once, in place in the block pool (next block prefetched), keeps scores and
the weighted sum in float32 and rounds the output once; every sequence has its own context length
(no padding, no groups). With AVX-512 and a head dim of 64, 128 or 256 and 1, 2, 4 or 8 query heads
per kv head, the scores are taken 16 keys at a time (per key a vector of partial dot products, bf16
pairs through vdpbf16ps where the CPU has AVX512-BF16; the 16 vectors summed across lanes at once;
with 4 query heads a kv head, 8 keys at a time with the 4 heads in one vector's lanes, ~40% fewer
vector operations, 0.91x-0.98x a decode step on Zen 4):
bf16, one thread, 32 x 500 tokens x 8 layers, 6.5-6.9 -> 4.8-5.8 ms (float32 11.2-11.7 -> 9.9-11.0,
bound by reading the cache); other shapes take the plain loops. It is built with the system's C++
compiler at first use (about a second, ``-O3 -march=native``, OpenMP over (sequence, kv head) when
torch has more than one thread), cached by a hash of its source, compiler and CPU under
``$CHATFLEET_CACHE/kernels`` (default ``~/.cache/chatfleet/kernels``), and loaded with ctypes
(``cpu_kernel_build``): no torch headers, so no extension build. Where no compiler is found or the
build fails, the caller keeps the torch-op path (``available()`` is False; one log line says why);
``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off, and ``CXX`` names another compiler.

On an AMX CPU (Intel Xeon, ``amx_bf16``), bf16 queries over a bf16 cache with a head dim of 64,
128 or 256 and a block size that is a multiple of 16 run on AMX tiles instead (``paged_decode_amx.h``):
16 keys of a block are one tile as they lie, dotted with the group's query heads as the other
operand; the softmax numerators are rounded to bf16 (as the chunk kernels round theirs) and V's
rows, paired by key, are weighed 32 keys a tile product. AMX Xeon, whole bf16 decode steps of
``small`` (``benchmarks/decode_stack_ab.py --switch attention``), against AVX-512: b32 x 530
tokens 0.74x-0.79x (1 and 2 threads), b8 x 2,000 tokens 0.68x. ``use_amx`` switches it, for A/B
runs and tests; its bits differ from AVX-512's (the bf16 numerators), each within the reference's
tolerance.

An FP8 cache (e4m3 codes, read as ``code * k_scale`` and ``code * v_scale``) takes the same kernel:
each run of 16 key rows is widened exactly into a small buffer of the query's dtype, each V row as
it is read, so a decode reads half a bf16 cache's bytes (the torch-op path instead gathers,
converts and scales padded copies of K and V: bf16, one thread, b32 x 500 tokens x 8 layers,
``benchmarks/fp8_kv_speed.py``). With bf16 queries and AVX512-BF16, V's rows are widened to bf16
(exactly) and weighed in pairs of keys by vdpbf16ps, the numerators rounded to bf16 as the chunk
kernels round them: Zen 4, one thread, 0.94x a b8 decode step and 0.91x-0.96x at b32.
``gather_fp8`` does the same widening for a prefill chunk's context (gather, convert and scale in
one pass, for the chunk attention kernels).

Shapes: q [B, Hq, D] (float32 or bfloat16), key/value [Hkv, num_blocks, block_size, D] in q's
dtype or ``float8_e4m3fn``, block_tables [B, W] int64 (at least ceil(ctx / block_size) valid
entries per row), context_lens [B] int64 (each >= 1, counting the new token); Hq / Hkv <= 8; D <= 512.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from chatfleet.engine.models.cpu_kernel_build import KernelLoader

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
MAX_HEAD_DIM = 512  # 64, 128 and 256 are compiled with the head dim fixed; others up to this read it
MAX_GROUP = 8
# Compiled with -ffast-math (vectorized expf from libmvec, reassociated sums) but linked without
# it: linking with -ffast-math adds crtfastmath.o, which sets flush-to-zero for the whole process
# when the library loads (subnormals would vanish in every other computation).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
DTYPES = (torch.float32, torch.bfloat16)
FP8 = torch.float8_e4m3fn


def _bind(lib: ctypes.CDLL) -> str | None:
    fn = lib.cf_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7
                   + [ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_float])
    gather = lib.cf_gather_fp8
    gather.restype = ctypes.c_int
    gather.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5
                       + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    store = lib.cf_store_kv
    store.restype = ctypes.c_int
    store.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 2
                      + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 5)
    store8 = lib.cf_store_kv_fp8
    store8.restype = ctypes.c_int
    store8.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 2
                       + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int, ctypes.c_float, ctypes.c_float])
    lib.cf_paged_amx_init.restype = ctypes.c_int
    lib.cf_paged_use_amx.restype = ctypes.c_int
    lib.cf_paged_use_amx.argtypes = (ctypes.c_int,)
    lib.cf_paged_prefetch_runs.restype = ctypes.c_int
    lib.cf_paged_prefetch_runs.argtypes = (ctypes.c_int,)
    lib.cf_paged_amx_init()  # bf16 over a bf16 cache on AMX tiles where the CPU has them and the OS grants them
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "paged decode C++ kernel", "decode attention runs on torch ops",
                       _bind)


def available() -> bool:
    """Whether the kernel is built and loaded here (builds it on first call)."""
    return _LOADER.available()


def address(symbol: str) -> int | None:
    """Where this library's exported function ``symbol`` lies (``decode_stack.py`` hands it to C++
    code), or None where the library is not loaded here."""
    return _LOADER.address(symbol)


def amx_in_use() -> bool:
    """Whether bf16 decode over a bf16 cache runs on AMX tiles here (the CPU has AMX, the OS granted
    its tile state and ``use_amx`` did not switch it off; block sizes that are multiples of 16, head
    dims 64, 128 and 256); else on AVX-512."""
    lib = _LOADER.load()
    return lib is not None and lib.cf_paged_use_amx(-1) == 1


def use_amx(on: bool) -> bool:
    """Switch bf16 decode over a bf16 cache to AMX tiles (where granted) or to AVX-512, for paired
    A/B measurements and tests; returns whether AMX is now in use."""
    lib = _LOADER.load()
    return lib is not None and lib.cf_paged_use_amx(int(on)) == 1


def prefetch_runs(on: bool | None = None) -> bool:
    """Whether the AVX-512 paths (float32, FP8 caches, bf16 without AMX) prefetch the blocks that
    continue a run in memory, not only scattered ones (the default: on Intel, not on AMD); ``on``
    switches it, for paired A/B measurements and tests (the results are the same bits either way)."""
    lib = _LOADER.load()
    return lib is not None and lib.cf_paged_prefetch_runs(-1 if on is None else int(on)) == 1


def fits(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernel takes a model of this shape: a CPU, float32 or bfloat16 queries over a
    cache of the same dtype or FP8 (e4m3), head dims up to MAX_HEAD_DIM, ``group`` (query heads
    per kv head) at most MAX_GROUP."""
    return (device.type == "cpu" and dtype in DTYPES and kv_dtype in (dtype, FP8) and head_dim <= MAX_HEAD_DIM
            and group <= MAX_GROUP)


def supports(q: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes (the caller falls back otherwise)."""
    num_heads, num_kv_heads = q.shape[1], key.shape[0]
    return num_heads % num_kv_heads == 0 and fits(q.device, q.dtype, key.dtype, q.shape[2], num_heads // num_kv_heads)


def paged_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, D] over each sequence's first ``context_lens[b]`` cached positions -> [B, Hq, D]
    (an FP8 cache read as ``code * k_scale`` / ``code * v_scale``; the scales are ignored otherwise)."""
    lib = _LOADER.load()
    if lib is None or not supports(q, key):
        raise RuntimeError("the paged decode C++ kernel cannot run here; check available() and supports()")
    batch, num_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, _ = key.shape
    q = q.contiguous()
    if out is None:
        out = torch.empty_like(q)
    for t in (key, value, block_tables, context_lens, out):
        assert t.is_contiguous()
    assert block_tables.dtype == torch.int64 and context_lens.dtype == torch.int64
    assert block_tables.shape[0] == batch and context_lens.shape[0] == batch
    rc = lib.cf_paged_decode(q.data_ptr(), key.data_ptr(), value.data_ptr(), out.data_ptr(),
                             block_tables.data_ptr(), context_lens.data_ptr(), batch, num_heads, num_kv_heads,
                             num_blocks, block_size, block_tables.shape[1], head_dim, scale,
                             int(q.dtype == torch.bfloat16), torch.get_num_threads(), int(key.dtype == FP8),
                             k_scale, v_scale)
    if rc:
        raise RuntimeError(f"paged decode C++ kernel refused the shapes (code {rc})")
    return out


def gather_fp8(cache: torch.Tensor, block_ids: torch.Tensor, scale: float, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The blocks ``block_ids`` of an FP8 cache tensor [Hkv, num_blocks, block_size, D] as
    [Hkv, len(block_ids), block_size, D] in ``dtype`` (float32 or bfloat16), each ``code * scale``
    rounded once: ``fp8_dequantize(gather_blocks(...))`` in one pass. None where the kernel does not
    take the operands (the caller uses torch ops then)."""
    if (not cache.is_cpu or cache.dtype != FP8 or dtype not in DTYPES or not cache.is_contiguous()
            or block_ids.dtype != torch.int64 or block_ids.dim() != 1 or not block_ids.is_contiguous()):
        return None
    lib = _LOADER.load()
    if lib is None:
        return None
    heads, num_blocks, block_size, head_dim = cache.shape
    shape = (heads, block_ids.shape[0], block_size, head_dim)
    if out is None or out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        out = torch.empty(shape, dtype=dtype)
    rc = lib.cf_gather_fp8(cache.data_ptr(), block_ids.data_ptr(), block_ids.shape[0], heads, num_blocks,
                           block_size, head_dim, scale, out.data_ptr(), int(dtype == torch.bfloat16))
    if rc:
        raise IndexError("a block id outside the cache")
    return out


def _store_layout_ok(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> bool:
    """Whether the store kernels take these operands' shapes and strides (dtypes are each one's own
    check): k, v [T, Hkv, D] alike with D contiguous, key/value [Hkv, num_blocks, block_size, D]
    alike and contiguous, slots [T] contiguous int64."""
    return (k.shape == v.shape and k.dim() == 3 and k.stride(2) == 1 and v.stride(2) == 1
            and key.is_contiguous() and value.is_contiguous() and slots.dtype == torch.int64
            and slots.is_contiguous() and slots.shape == (k.shape[0],) and key.shape[0] == k.shape[1]
            and key.shape[3] == k.shape[2] and key.shape == value.shape)


def store_kv(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> bool:
    """Write k, v [T, Hkv, D] (any row and head strides, D contiguous) into the cache's flat slots
    ``slots`` [T] (int64) of key/value [Hkv, num_blocks, block_size, D]: what two ``index_copy_``
    over the cache do, in one pass. False (nothing written) where the kernel does not take the
    operands: the caller writes with torch ops then."""
    if not key.is_cpu:
        return False
    lib = _LOADER.load()
    if (lib is None or not (key.dtype == value.dtype == k.dtype == v.dtype)
            or not _store_layout_ok(key, value, slots, k, v)):
        return False
    heads, num_blocks, block_size, head_dim = key.shape
    rc = lib.cf_store_kv(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                         key.data_ptr(), value.data_ptr(), slots.data_ptr(), k.shape[0], heads, head_dim,
                         num_blocks * block_size, key.element_size())
    if rc:
        raise IndexError("a KV slot outside the cache")
    return True


def store_kv_fp8(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_scale: float, v_scale: float) -> bool:
    """``store_kv`` into an FP8 cache: k, v [T, Hkv, D] (float32 or bfloat16) stored as
    ``kv_cache.quantize_fp8(k, k_scale)`` (and v) stores them, the same codes, in one pass. False
    (nothing written) where the kernel does not take the operands."""
    if not key.is_cpu:
        return False
    lib = _LOADER.load()
    if (lib is None or key.dtype != FP8 or value.dtype != FP8 or k.dtype not in DTYPES or v.dtype != k.dtype
            or not _store_layout_ok(key, value, slots, k, v)):
        return False
    heads, num_blocks, block_size, head_dim = key.shape
    rc = lib.cf_store_kv_fp8(k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                             key.data_ptr(), value.data_ptr(), slots.data_ptr(), k.shape[0], heads, head_dim,
                             num_blocks * block_size, int(k.dtype == torch.bfloat16), k_scale, v_scale)
    if rc:
        raise IndexError("a KV slot outside the cache")
    return True


def paged_decode_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """The kernel's torch reference: per sequence, gather its blocks and attend in float32 (an FP8
    cache converted by torch and scaled first)."""
    if key.dtype == FP8:
        key, value = key.float() * k_scale, value.float() * v_scale
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = key.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for b in range(batch):
        ctx = int(context_lens[b])
        ids = block_tables[b, : -(-ctx // block_size)]
        k = key[:, ids].reshape(num_kv_heads, -1, head_dim)[:, :ctx].float().repeat_interleave(group, 0)
        v = value[:, ids].reshape(num_kv_heads, -1, head_dim)[:, :ctx].float().repeat_interleave(group, 0)
        scores = torch.einsum("hd,htd->ht", q[b].float(), k) * scale
        out[b] = torch.einsum("ht,htd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
