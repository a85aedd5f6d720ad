"""The names of the kernel backends that run a model's products (``linear.py`` implements them):
``auto`` (oneDNN on CPU where available, else torch), ``onednn``, ``torch``; and of the CPU's
decode attention kernels (``DECODE_KERNELS``: ``auto``, ``cpp`` (``paged_decode_cpu.py``),
``torch``; the runner resolves ``auto``). Torch-free, so the engine's config checks a name
without importing the kernels."""

from __future__ import annotations

KERNEL_BACKENDS = ("auto", "onednn", "torch")
DECODE_KERNELS = ("auto", "cpp", "torch")
