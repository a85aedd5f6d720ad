"""Block-scaled FP8 GEMM through ``torch._scaled_mm`` (cuBLAS), for the compute-bound side
(M above ``fp8_gemm.SMALL_M``: prefill chunks).

cuBLAS (CUDA 12.9+, sm90+) takes FP8 operands with 1x128 activation groups and 128x128 weight
blocks, the checkpoint format's granularity, when torch exposes it. The activations are
quantized per token and 128-column group (``amax / 448``), the weight and its scales are used
as stored. Which torch builds and cards accept this varies, and a layout misread would be
silent, so the first call in a process is checked against the dequantizing reference; a
refusal or a wrong answer turns the path off for the process (the caller dequantizes).
"""

from __future__ import annotations

import logging

import torch

from chatfleet.engine.models.fp8_format import E4M3_MAX
from chatfleet.engine.models.fp8_linear import FP8

log = logging.getLogger(__name__)
GROUP = 128
CHECK_TOLERANCE = 5e-2  # of the output's largest magnitude: FP8 activations cost ~1%, a misread ~100%

_state: dict[str, bool] = {}  # "ok": verified on this process's first call; "off": refused or wrong


def can_use(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    n, k = weight.shape
    return (x.is_cuda and weight.dtype == FP8 and block == (GROUP, GROUP) and k % GROUP == 0 and n % GROUP == 0
            and hasattr(torch, "_scaled_mm") and not _state.get("off", False))


def _quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, K / 128] laid out column-major)."""
    m, k = x.shape
    groups = x.float().view(m, k // GROUP, GROUP)
    scale = (groups.abs().amax(dim=-1) / E4M3_MAX).clamp_min(1e-12)
    q = (groups / scale[..., None]).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8).view(m, k)
    return q, scale.t().contiguous().t()


def scaled_mm_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    reference: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x [M, K] (W * S)^T`` in x's dtype, or None where this torch / GPU cannot (then never
    again in this process). ``reference``: the dequantized answer, for the first call's check."""
    try:
        xq, sx = _quantize_groups(x)
        y = torch._scaled_mm(xq, weight.t(), scale_a=sx, scale_b=scale.float().t(), out_dtype=x.dtype)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        log.info("torch._scaled_mm has no 1x128/128x128 block scaling here (%s); FP8 GEMMs dequantize", e)
        _state["off"] = True
        return None
    if reference is not None and not _state.get("ok"):
        err = (y.float() - reference.float()).abs().max() / reference.float().abs().max().clamp_min(1e-30)
        if not bool(err <= CHECK_TOLERANCE):
            log.warning("torch._scaled_mm block scaling disagrees with the reference (%.3g); not used", float(err))
            _state["off"] = True
            return None
        _state["ok"] = True
    return y


def verified() -> bool:
    """Whether the path passed its first-call check in this process."""
    return _state.get("ok", False)
