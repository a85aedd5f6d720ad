"""Whole KV blocks between a CPU engine's paged caches and its host tier, in one pass over their
bytes (``block_copy_cpu.cpp``), where the kernel builds; else ``kv_transfer.py`` keeps its torch ops.

Why hand-written: on the CPU the "device" cache and the host tier are both host memory, and
torch has no op that gathers blocks from one indexed tensor straight into another. A load was an
``index_select`` of the host slabs into a staging tensor, then an ``index_copy_`` per layer and K/V
(two passes over the bytes); a store an ``index_select`` per layer and K/V, a ``stack``, and an
``index_copy_`` of the permuted stack (three). Here each block's (layer, K/V, head) chunk is one
``memcpy`` between its two places. At ``capacity.py``'s ``all`` knee (AMX Xeon, bf16, one thread)
host transfers took ~5% of the engine core's time: a returning turn's ~78 blocks (5.1 MB) loaded
in 1.6-1.8 ms and stored in 2.0-2.4 ms. Measured numbers are in benchmarks/README.md.

Layouts (checked when the copier is built, else the torch path runs): the host tier
``[host_blocks, 2 * layers, heads, block_size, head_dim]``, contiguous; each cache tensor
``[heads, num_blocks, block_size, head_dim]`` with its last two dims contiguous, every tensor the
host's per-block chunk (block_size * head_dim elements of the host's dtype) long per block. Block
ids are checked against both sides' counts here: the C++ side trusts them.

Built like the model kernels (``cpu_kernel_build``: system compiler at first use, cached by source,
compiler and CPU); ``CHATFLEET_NO_CPU_KERNEL=1`` keeps it off.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import torch

from chatfleet.engine.models.cpu_kernel_build import KernelLoader

SOURCE = Path(__file__).with_name("block_copy_cpu.cpp")
FLAGS = ("-O2", "-fopenmp", "-fPIC", "-std=c++17")
LINK_FLAGS = ("-shared", "-fopenmp")


def _bind(lib: ctypes.CDLL) -> str | None:
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.cf_copy_blocks.restype = cint
    lib.cf_copy_blocks.argtypes = (ptr, i64, ptr, ptr, i64, i64, i64, ptr, ptr, i64, cint, cint)
    return None


_LOADER = KernelLoader(SOURCE, FLAGS, LINK_FLAGS, "host-tier block copy kernel", "host transfers run as torch ops",
                       _bind)


def available() -> bool:
    """Whether the kernel is built and loaded here (builds it on first call)."""
    return _LOADER.available()


class BlockCopier:
    """Copies whole blocks between ``host`` ([host_blocks, len(tensors), heads, block, dim],
    contiguous) and ``tensors`` (K0, V0, K1, V1, ...: [heads, blocks, block, dim]), all CPU tensors
    of one element size. ``BlockCopier.for_tensors`` gives None where the kernel cannot take them."""

    def __init__(self, host: torch.Tensor, tensors: Sequence[torch.Tensor], lib: ctypes.CDLL) -> None:
        self._host = host
        self._tensors = list(tensors)  # keeps the buffers alive while their addresses are held
        self._lib = lib
        heads, _, block, dim = tensors[0].shape
        elem = host.element_size()
        self._heads = heads
        self._chunk_bytes = block * dim * elem
        self._host_block_bytes = host.stride(0) * elem
        self._num_host_blocks = host.shape[0]
        self._num_device_blocks = min(t.shape[1] for t in tensors)
        self._ptrs = (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))
        self._strides = (ctypes.c_int64 * len(tensors))(*(t.stride(0) * elem for t in tensors))

    @classmethod
    def for_tensors(cls, host: torch.Tensor, tensors: Sequence[torch.Tensor]) -> BlockCopier | None:
        """A copier where the kernel is loaded and the layouts are the ones it reads, else None."""
        if (not tensors or host.device.type != "cpu" or not host.is_contiguous() or host.dim() != 5
                or any(t.dim() != 4 for t in tensors)):
            return None
        heads, _, block, dim = tensors[0].shape
        if host.shape[1:] != (len(tensors), heads, block, dim):
            return None
        for t in tensors:
            if (t.device.type != "cpu" or t.shape[0] != heads or t.shape[2:] != (block, dim)
                    or t.element_size() != host.element_size() or t.stride(3) != 1 or t.stride(2) != dim
                    or t.stride(1) != block * dim):
                return None
        lib = _LOADER.load()
        return None if lib is None else cls(host, tensors, lib)

    def copy(self, host_ids: Sequence[int], device_ids: Sequence[int], to_host: bool) -> None:
        """Block ``device_ids[j]`` of every tensor to (``to_host``) or from host block ``host_ids[j]``."""
        if len(host_ids) != len(device_ids):
            raise ValueError(f"{len(host_ids)} host blocks for {len(device_ids)} device blocks")
        if not host_ids:
            return
        h = torch.tensor(host_ids, dtype=torch.int64)
        d = torch.tensor(device_ids, dtype=torch.int64)
        if int(h.min()) < 0 or int(h.max()) >= self._num_host_blocks or int(d.min()) < 0 \
                or int(d.max()) >= self._num_device_blocks:
            raise IndexError(f"block ids out of range: host {host_ids} (of {self._num_host_blocks}), "
                             f"device {device_ids} (of {self._num_device_blocks})")
        rc = self._lib.cf_copy_blocks(self._host.data_ptr(), self._host_block_bytes, self._ptrs, self._strides,
                                      len(self._tensors), self._heads, self._chunk_bytes, h.data_ptr(),
                                      d.data_ptr(), len(host_ids), int(to_host), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"host-tier block copy kernel refused the sizes (code {rc})")
