"""Write a checkpoint's weights the way Hugging Face FP8 checkpoints store them.

``to_fp8_checkpoint(weights, fmt)``: every linear weight (``*_proj.weight`` of the decoder
layers) becomes e4m3 with its float32 scale tensor beside it (``weight_scale_inv`` for
block-wise ``[128, 128]`` scales, ``weight_scale`` per tensor or per channel); embeddings,
lm_head and norms stay in 16 bits (bfloat16), as in Qwen3-*-FP8. ``fmt.to_hf()`` is the
matching ``quantization_config``.
"""

from __future__ import annotations

import re

import torch

from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import quantize_weight

FP8_SUFFIX = "-fp8"  # built-in model names: "tiny-fp8", "small-fp8"
_LINEAR_RE = re.compile(r"^model\.layers\.\d+\..*_proj\.weight$")


def to_fp8_checkpoint(weights: dict[str, torch.Tensor], fmt: FP8WeightFormat) -> dict[str, torch.Tensor]:
    """HF tensor names -> the FP8 checkpoint's tensors (see module doc)."""
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        module = name.removesuffix(".weight")
        if _LINEAR_RE.match(name) and not fmt.is_ignored(module):
            q, scale = quantize_weight(w, fmt)
            out[name] = q
            out[f"{module}.{fmt.scale_name}"] = scale.reshape(fmt.scale_shape(*w.shape)).contiguous()
        else:
            out[name] = w.to(torch.bfloat16)
    return out
