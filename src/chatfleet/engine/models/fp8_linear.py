"""FP8 weights: quantize, dequantize, and a linear layer that keeps its weight in FP8.

An FP8 weight is one matrix ``[out, in]`` (or a stack ``[E, out, in]`` of expert matrices) in
e4m3 with float32 scales laid out as the checkpoint format says (``fp8_format.py``): block-wise
``[ceil(out/bo), ceil(in/bi)]`` (edge tiles are partial), per-tensor ``[]`` or per-channel
``[out, 1]``. ``weight ~= fp8 * scale``.

``FP8Linear`` holds one FP8 weight per *part* (q/k/v of a fused projection keep their own
scales: their row counts need not be multiples of the block) and computes ``x W^T + b`` by
dequantizing its parts into one shared workspace in the activation dtype and calling
``F.linear``: only one layer's weight is ever dequantized at a time. On CUDA, parts with
per-tensor or per-channel scales and shapes divisible by 16 use ``torch._scaled_mm`` with the
activations quantized per token; anything else, or a failure there, dequantizes. A layer given
a ``block_gemm`` (``use_block_gemm``; the runner gives ``kernels.fp8_gemm.fp8_block_linear`` on a
GPU) sends block-scaled parts through it instead: the weight is read as stored, never
dequantized. The models never import the kernels; the runner hands them in.

MoE experts stored as one ``[E, out, in]`` e4m3 tensor with scales ``[E, ...]`` use the same
functions one expert at a time: ``quantize_weight(w[e], fmt)`` / ``dequantize_weight(q[e],
s[e], fmt, dtype, out=workspace_slice)`` (``engine/sizing/memory.py`` prices them as class ``experts``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chatfleet.engine.models.fp8_cast import fp8_placed, placed_down
from chatfleet.engine.models.fp8_format import E4M3_MAX, FP8WeightFormat, ceil_div
from chatfleet.engine.models.workspace import Workspace

FP8 = torch.float8_e4m3fn
log = logging.getLogger(__name__)

# x [M, K], an e4m3 weight [N, K], its block scales, the block -> x W^T [M, N]
BlockGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor]


def _scale_tiles(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int], op: str) -> torch.Tensor:
    """Multiply (``op="mul"``) or divide ``w [out, in]`` in place by block scales ``s [ob, ib]``,
    partial edge tiles included, through views (no expanded copy of the scales)."""
    bo, bi = block
    out_f, in_f = w.shape
    fo, fi = out_f // bo, in_f // bi  # whole tiles
    r, c = fo * bo, fi * bi
    apply = torch.Tensor.mul_ if op == "mul" else torch.Tensor.div_
    if fo and fi:
        apply(w[:r, :c].view(fo, bo, fi, bi), s[:fo, :fi].view(fo, 1, fi, 1))
    if c < in_f and fo:
        apply(w[:r, c:].view(fo, bo, in_f - c), s[:fo, fi].view(fo, 1, 1))
    if r < out_f and fi:
        apply(w[r:, :c].view(out_f - r, fi, bi), s[fo, :fi].view(1, fi, 1))
    if r < out_f and c < in_f:
        apply(w[r:, c:], s[fo, fi])
    return w


def quantize_weight(w: torch.Tensor, fmt: FP8WeightFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` (any float dtype) -> (e4m3 weight, float32 scales) with scale = amax / 448."""
    w32 = w.detach().float()
    out_f, in_f = w32.shape
    if fmt.granularity == "tensor":
        scale = (w32.abs().amax() / E4M3_MAX).clamp_min(1e-12)
        return (w32 / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8), scale.reshape(())
    if fmt.granularity == "channel":
        scale = (w32.abs().amax(dim=1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
        return (w32 / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8), scale
    bo, bi = fmt.block
    ob, ib = ceil_div(out_f, bo), ceil_div(in_f, bi)
    padded = torch.zeros(ob * bo, ib * bi)
    padded[:out_f, :in_f] = w32.abs()
    scale = (padded.view(ob, bo, ib, bi).amax(dim=(1, 3)) / E4M3_MAX).clamp_min(1e-12)
    q = _scale_tiles(w32.clone(), scale, fmt.block, "div").clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, scale


@dataclass(frozen=True)
class FoldedScale:
    """A weight's scales in the compute dtype with the placement's power of two folded in
    (``pre``: a factor to apply first instead, where folding would overflow)."""

    scale: torch.Tensor
    pre: float = 1.0


def fold_scale(scale: torch.Tensor, dtype: torch.dtype) -> FoldedScale:
    """``scale`` ready to multiply ``fp8_placed`` weights in ``dtype``."""
    down = placed_down(dtype)
    s = (scale.float() * down).to(dtype)  # a power of two: the same rounding as ``scale.to(dtype)``
    if bool(torch.isfinite(s).all()):
        return FoldedScale(s)
    return FoldedScale(scale.to(dtype), pre=down)  # a scale of 2**8 or more: undo the placement first


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, fmt: FP8WeightFormat, dtype: torch.dtype,
                      out: torch.Tensor | None = None, folded: FoldedScale | None = None) -> torch.Tensor:
    """``q * scale`` as ``dtype`` (into ``out`` [out, in] when given): the e4m3 bits placed into
    ``dtype``'s (``fp8_cast.py``, three integer passes), then one multiplication by the scales
    (``folded``: ``fold_scale(scale, dtype)`` computed before, else now)."""
    w = fp8_placed(q, dtype, out)
    f = folded if folded is not None else fold_scale(scale, dtype)
    if f.pre != 1.0:
        w.mul_(f.pre)
    s = f.scale
    if fmt.granularity == "tensor":
        return w.mul_(s)
    if fmt.granularity == "channel":
        return w.mul_(s.view(-1, 1))
    return _scale_tiles(w, s, fmt.block, "mul")


class FP8Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` the row-wise concatenation of FP8 parts (see module doc).

    Buffers ``weight_{i}`` (e4m3 ``[out_i, in]``) and ``scale_{i}`` (float32) per part ``i``.
    """

    weight_0: torch.Tensor  # the first part's buffer (every layer has one), declared for the type checker

    def __init__(self, in_features: int, part_sizes: list[int], fmt: FP8WeightFormat, bias: bool = False,
                 dtype: torch.dtype = torch.float32, workspace: Workspace | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, sum(part_sizes)
        self.part_sizes = list(part_sizes)
        self.fmt = fmt
        for i, n in enumerate(part_sizes):
            self.register_buffer(f"weight_{i}", torch.empty(n, in_features, dtype=FP8))
            self.register_buffer(f"scale_{i}", torch.ones(fmt.scale_shape(n, in_features), dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype)) if bias else None
        self._scaled_mm_ok = True
        # Scales in the compute dtype, per part, keyed by (dtype, the scale tensors' versions):
        # a few bytes per 128x128 block, recomputed if a scale is written again.
        self._folded: tuple[tuple, list[FoldedScale]] | None = None
        # Where the dequantized weight goes: share one per model (its layers run one at a time);
        # None: a fresh tensor per call.
        self.workspace = workspace
        self.block_gemm: BlockGemm | None = None  # set: block-scaled parts go through it

    def part(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"weight_{i}"), getattr(self, f"scale_{i}")

    def set_part(self, i: int, weight: torch.Tensor, scale: torch.Tensor | None = None) -> None:
        """Load part ``i``: an e4m3 weight with its scale, or a float weight to quantize."""
        target_w, target_s = self.part(i)
        if weight.dtype != FP8:
            weight, scale = quantize_weight(weight, self.fmt)
        assert scale is not None
        if tuple(weight.shape) != tuple(target_w.shape):
            raise ValueError(f"FP8 weight has shape {tuple(weight.shape)}, expected {tuple(target_w.shape)}")
        target_w.copy_(weight)
        target_s.copy_(scale.reshape(target_s.shape))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight ``[out, in]`` in ``dtype`` (in the shared workspace when there is one)."""
        shape = (self.out_features, self.in_features)
        ws = self.workspace
        w = ws.get("fp8_weight", shape, dtype, self.weight_0.device) if ws else torch.empty(
            shape, dtype=dtype, device=self.weight_0.device)
        folded = self.folded_scales(dtype)
        row = 0
        for i, n in enumerate(self.part_sizes):
            q, s = self.part(i)
            dequantize_weight(q, s, self.fmt, dtype, w[row : row + n], folded[i])
            row += n
        return w

    def folded_scales(self, dtype: torch.dtype) -> list[FoldedScale]:
        """Each part's scales folded for ``dtype`` (computed once, again only if a scale changes)."""
        scales = [self.part(i)[1] for i in range(len(self.part_sizes))]
        key = (dtype, tuple(s._version for s in scales))
        if self._folded is None or self._folded[0] != key:
            self._folded = (key, [fold_scale(s, dtype) for s in scales])
        return self._folded[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_gemm is not None and self.fmt.granularity == "block":
            return self._block_gemm(x, self.block_gemm)
        if x.is_cuda and self._scaled_mm_ok and self.fmt.granularity != "block":
            try:
                return self._scaled_mm(x)
            except (RuntimeError, NotImplementedError) as e:  # unsupported GPU or shape: dequantize
                log.info("torch._scaled_mm unavailable (%s); FP8 linears dequantize instead", e)
                self._scaled_mm_ok = False
        return F.linear(x, self.dequantized(x.dtype), self.bias)

    def _block_gemm(self, x: torch.Tensor, gemm: BlockGemm) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        outs = [gemm(x2, *self.part(i), self.fmt.block) for i in range(len(self.part_sizes))]
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def _scaled_mm(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[1] % 16 or any(n % 16 for n in self.part_sizes):
            raise RuntimeError("shapes not divisible by 16")
        sx = (x2.abs().amax(dim=1, keepdim=True).float() / E4M3_MAX).clamp_min(1e-12)  # per token
        xq = (x2.float() / sx).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)
        outs = []
        for i, n in enumerate(self.part_sizes):
            q, s = self.part(i)
            sw = s.reshape(1, n) if self.fmt.granularity == "channel" else s.reshape(1, 1).expand(1, n).contiguous()
            outs.append(torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype))
        y = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, parts={self.part_sizes}, {self.fmt.describe()}"
