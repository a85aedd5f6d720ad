"""Linear layers for inference, and the named kernel backends that run the model's products.

On CPU, PyTorch's default ``F.linear`` calls MKL, which takes its AVX2 code path on AMD CPUs;
oneDNN with the weight reordered once into its blocked layout runs the same product with
AVX-512 (here 2-2.5x faster in float32, 1.2-1.6x in bfloat16). ``Linear.pack()`` does that
reorder after the weights are loaded and drops the plain copy. A packed linear of at most
``packed_gemv.MAX_ROWS`` rows (a decode step's) reads the same packed bytes in a C++ kernel where
their layout checks out (``packed_gemv.py``), streaming the weight faster than oneDNN does there.

Kernel backends (``load_model(..., kernels=...)``): ``onednn`` (prepacked linears and oneDNN
attention products, CPU only), ``torch`` (``F.linear`` and ``F.scaled_dot_product_attention``),
``auto`` (``onednn`` where it is available, else ``torch``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from chatfleet.engine.models import packed_gemv
from chatfleet.engine.models.backends import KERNEL_BACKENDS
from chatfleet.errors import ConfigError

_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear can run on this device and dtype."""
    if device.type != "cpu" or dtype not in _ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_kernel_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """The concrete backend (``onednn`` or ``torch``) for a requested name."""
    if name not in KERNEL_BACKENDS:
        raise ConfigError(f"unknown kernel backend {name!r}; valid: {', '.join(KERNEL_BACKENDS)}")
    if name == "auto":
        return "onednn" if onednn_available(device, dtype) else "torch"
    if name == "onednn" and not onednn_available(device, dtype):
        raise ConfigError(f"the onednn kernel backend needs a CPU with oneDNN and float32/bfloat16, "
                          f"got {device.type} {dtype}")
    return name


def onednn_matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` through oneDNN (a: [M, K], b: [N, K], both contiguous, same dtype)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``weight`` [out, in]; ``pack()`` switches it to oneDNN."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None
        self.packed_layout: packed_gemv.PackedLayout | None = None  # where few rows read ``packed``

    def pack(self) -> None:
        """Reorder the weight for oneDNN once and release the plain copy."""
        if self.packed is not None:
            return
        assert self.weight is not None
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.packed_layout = packed_gemv.packed_layout(self.packed, self.weight.detach())
        del self._parameters["weight"]
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and packed_gemv.runs(x, self.packed_layout):  # decode rows (packed_gemv.py)
            assert self.packed_layout is not None
            return packed_gemv.packed_linear(x, self.packed, self.packed_layout, self.bias)
        if self.packed is not None:  # the resolved overload: no overload matching per call
            return torch.ops.mkldnn._linear_pointwise.default(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.packed is not None}")


class KernelsChoice(Protocol):
    """An attention module's prefill backend (``onednn`` or ``torch``)."""

    kernels: str


def switch_kernels(model: nn.Module, attention: Iterable[KernelsChoice], current: str, kernels: str) -> str:
    """Move ``model`` to a resolved kernel backend and return it: ``onednn`` packs every linear
    (once, for good) and each attention module gets the backend for its prefill path."""
    if kernels not in ("onednn", "torch"):
        raise ValueError(f"kernels must be 'onednn' or 'torch', got {kernels!r}")
    if current == "onednn" and kernels != "onednn":
        raise ValueError("linears already packed for oneDNN cannot go back to torch")
    if kernels == "onednn":
        for module in model.modules():
            if isinstance(module, Linear):
                module.pack()
    for attn in attention:
        attn.kernels = kernels
    return kernels
