"""A SwiGLU MLP's first half, ``silu(x Wg^T) * (x Wu^T)``, from its fused [gate; up] projection.

``GateUpLinear`` is that projection ([2I, H], loaded like any ``Linear``). Packed for oneDNN in
bfloat16 it keeps the two halves apart and runs the activation and the product inside oneDNN's
GEMM epilogues: the gate product with a ``swish`` post-op (``x * sigmoid(x)``, alpha 1: silu),
the up product with a binary ``mul`` by that result. No [T, 2I] tensor is written and read back
by a separate pass, and each value is rounded to bfloat16 twice (the activated gate, the product)
instead of three times (gate_up, silu, product): on ``small``'s MLP its largest error against the
float64 product is 0.7% of the value where the unfused path's is 1.2%. On an AMX Xeon, one thread, ``small``'s
1,536-wide MLP: 1,779 -> 1,543 us at 500 rows, 224 -> 216 us at 32, 174 -> 179 us at 1 (two
products' call overhead where the weights' read dominates). In float32 the fused form measured
no faster (8,668 vs 8,783 us at 500 rows), so float32, unpacked and FP8 projections take the
product then ``silu_and_mul`` (row_ops.py).

Only the packed bfloat16 halves are kept (no plain or fused copy: the MLP's weights are most of
a model's), so ``forward`` there concatenates the two products, for callers that want gate_up.
A decode step's few rows run both products, the swish and the multiply in ``packed_gemv``'s kernel
over the same packed bytes: its swish is oneDNN's eltwise swish operation for operation (its exp
polynomial, its sigmoid), so the bits are the post-ops' and a row's activation does not depend on
the step's row count (a silu of our own differed in 2 of 12,288 values, enough to break the
chunked-prefill greedy equivalence tests).
"""

from __future__ import annotations

import torch
from torch import nn

from chatfleet.engine.models import packed_gemv
from chatfleet.engine.models.linear import Linear
from chatfleet.engine.models.row_ops import silu_and_mul


class GateUpLinear(Linear):
    """``[gate; up]`` = x [Wg; Wu]^T with Wg, Wu [intermediate, in]; ``swiglu(self, x)`` applies
    the activation (fused in oneDNN where packed in bfloat16)."""

    def __init__(self, in_features: int, intermediate_size: int) -> None:
        super().__init__(in_features, 2 * intermediate_size, bias=False)
        self.intermediate_size = intermediate_size
        self.packed_halves: tuple[torch.Tensor, torch.Tensor] | None = None
        self.halves_layout: packed_gemv.PackedLayout | None = None  # both halves', where few rows read them

    def pack(self) -> None:
        """bfloat16: reorder the gate and up halves for oneDNN apart and release the plain copy;
        other dtypes: ``Linear.pack``."""
        if self.packed is not None or self.packed_halves is not None:
            return
        assert self.weight is not None
        if self.weight.dtype != torch.bfloat16:
            super().pack()
            return
        w = self.weight.detach()
        i = self.intermediate_size
        reorder = torch.ops.mkldnn._reorder_linear_weight
        gate, up = w[:i].contiguous(), w[i:].contiguous()
        self.packed_halves = (reorder(gate, None), reorder(up, None))
        layouts = (packed_gemv.packed_layout(self.packed_halves[0], gate),
                   packed_gemv.packed_layout(self.packed_halves[1], up))
        self.halves_layout = layouts[0] if layouts[0] == layouts[1] else None
        del self._parameters["weight"]
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_halves is None:
            return super().forward(x)
        linear = torch.ops.mkldnn._linear_pointwise.default
        gate, up = self.packed_halves
        return torch.cat([linear(x, gate, None, "none", [], ""), linear(x, up, None, "none", [], "")], dim=-1)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", packed_halves={self.packed_halves is not None}"


def swiglu(gate_up: nn.Module, x: torch.Tensor, intermediate_size: int) -> torch.Tensor:
    """``silu(gate) * up`` for x [T, in] through ``gate_up`` (a ``GateUpLinear``, or whatever
    replaced it, e.g. an FP8 linear, returning [T, 2 * intermediate_size]): [T, intermediate_size]."""
    halves = gate_up.packed_halves if isinstance(gate_up, GateUpLinear) else None
    if halves is None:
        return silu_and_mul(gate_up(x), intermediate_size)
    gate, up = halves
    layout = gate_up.halves_layout if isinstance(gate_up, GateUpLinear) else None
    if packed_gemv.runs(x, layout):  # decode rows: both halves, the swish and the product in the C++ kernel
        assert layout is not None
        activated = packed_gemv.packed_linear(x, gate, layout, swish=True)
        return packed_gemv.packed_linear(x, up, layout, mul=activated)
    activated = torch.ops.mkldnn._linear_pointwise.default(x, gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, activated, up, None, "mul")
