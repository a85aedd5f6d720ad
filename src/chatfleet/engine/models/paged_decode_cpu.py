"""Paged decode attention on the CPU in one small C++ kernel (``paged_decode_cpu.cpp``), with its
torch reference.

Why hand-written: the torch-op path (``decode_attention.py``) gathers every sequence's K blocks
into a padded copy (``index_select``), multiplies (``bmm``), softmaxes, and sums V rows with
``embedding_bag``: K is read twice and written once, scores go through memory in 16 bits, and a
batch of 32 x 500-token decodes spends ~45% of a decode step there (issue 20's profile). Fused
SDPA kernels need K/V contiguous per sequence, so they would need the same gather. The kernel
reads each sequence's K and V rows once, in place in the block pool (next block prefetched),
keeps scores and the weighted sum in float32 and rounds the output once; every sequence has its
own context length (no padding, no groups). It is built with the system's C++ compiler at first
use (about a second, ``-O3 -march=native``, OpenMP over (sequence, kv head) when torch has more
than one thread), cached by a hash of its source, compiler and CPU under
``$CHATFLEET_CACHE/kernels`` (default ``~/.cache/chatfleet/kernels``), and loaded with ctypes:
no torch headers, so no extension build. Where no compiler is found or the build fails, the
caller keeps the torch-op path (``available()`` is False; one log line says why);
``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off, and ``CXX`` names another compiler.

Shapes: q [B, Hq, D] (float32 or bfloat16), key/value [Hkv, num_blocks, block_size, D] in q's
dtype, block_tables [B, W] int64 (at least ceil(ctx / block_size) valid entries per row),
context_lens [B] int64 (each >= 1, counting the new token); Hq / Hkv <= 8; D <= 512.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode_cpu.cpp")
MAX_HEAD_DIM = 512  # 64, 128 and 256 are compiled with the head dim fixed; others up to this read it
MAX_GROUP = 8
# Compiled with -ffast-math (vectorized expf from libmvec, reassociated sums) but linked without
# it: linking with -ffast-math adds crtfastmath.o, which sets flush-to-zero for the whole process
# when the library loads (subnormals would vanish in every other computation).
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")
DTYPES = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    env = os.environ.get("CHATFLEET_CACHE")
    return (Path(env) if env else Path.home() / ".cache" / "chatfleet") / "kernels"


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model name and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def compiler() -> str | None:
    """The C++ compiler the CPU kernels are built with (``$CXX``, else g++, c++ or clang++ on PATH)."""
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def build_library(cxx: str, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS,
                  link_flags: tuple[str, ...] = LINK_FLAGS) -> Path:
    """Build ``source`` into a shared library once (cached by a hash of the source, compiler,
    flags and CPU) and return its path; OSError where the compiler fails."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256("\n".join((source.read_text(), cxx, version, " ".join(flags + link_flags),
                                       _cpu_signature()))
                            .encode()).hexdigest()[:16]
    target = _cache_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    obj = tmp[: -len(".so")] + ".o"
    try:
        for argv in ([cxx, *flags, "-c", "-o", obj, str(source)], [cxx, *link_flags, "-o", tmp, obj]):
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if proc.returncode:
                raise OSError(f"{cxx} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: concurrent builders agree on the result
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("CHATFLEET_NO_CPU_KERNEL"):
            log.info("paged decode C++ kernel disabled by CHATFLEET_NO_CPU_KERNEL: torch ops decode")
            return None
        cxx = compiler()
        if cxx is None:
            log.info("no C++ compiler found: decode attention runs on torch ops")
            return None
        try:
            lib = ctypes.CDLL(str(build_library(cxx)))
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("paged decode C++ kernel unavailable (%s): decode attention runs on torch ops", e)
            return None
        fn = lib.cf_paged_decode
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_int]
        _lib = lib
        return lib


def available() -> bool:
    """Whether the kernel is built and loaded here (builds it on first call)."""
    return _load() is not None


def fits(device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int, group: int) -> bool:
    """Whether the kernel takes a model of this shape: a CPU, float32 or bfloat16 queries over a
    cache of the same dtype, head dims up to MAX_HEAD_DIM, ``group`` (query heads per kv head) at
    most MAX_GROUP."""
    return (device.type == "cpu" and dtype in DTYPES and kv_dtype == dtype and head_dim <= MAX_HEAD_DIM
            and group <= MAX_GROUP)


def supports(q: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these shapes and dtypes (the caller falls back otherwise)."""
    num_heads, num_kv_heads = q.shape[1], key.shape[0]
    return num_heads % num_kv_heads == 0 and fits(q.device, q.dtype, key.dtype, q.shape[2], num_heads // num_kv_heads)


def paged_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] over each sequence's first ``context_lens[b]`` cached positions -> [B, Hq, D]."""
    lib = _load()
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
                             int(q.dtype == torch.bfloat16), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"paged decode C++ kernel refused the shapes (code {rc})")
    return out


def paged_decode_reference(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel's torch reference: per sequence, gather its blocks and attend in float32."""
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
