"""Load a Hugging Face model folder (Qwen3 or Gemma 4): pick the architecture from config.json,
check the precision asked for, and hand the folder to that architecture's weight loader
(``qwen3_weights.py``, ``gemma4_weights.py``).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from chatfleet.engine.models.checkpoint import LoadedModel, read_hf_config
from chatfleet.engine.models.dtype import dtype_for_auto
from chatfleet.engine.models.fp8_format import FP8WeightFormat, weights_format_for
from chatfleet.engine.models.gemma4_config import is_gemma4
from chatfleet.engine.models.gemma4_weights import load_gemma4
from chatfleet.engine.models.qwen3_weights import load_qwen3
from chatfleet.errors import ConfigError


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", kernels: str = "auto",
               language_model_only: bool = True, quantization: str | None = None,
               embedding_dtype: str = "auto") -> LoadedModel:
    """Build the model from ``path`` (an HF Qwen3 or Gemma 4 folder) in ``dtype`` on ``device``
    (``dtype="auto"``: see ``dtype.py``).

    ``kernels``: ``auto`` (oneDNN on CPU where available), ``onednn`` or ``torch``; see linear.py.
    ``language_model_only``: a multimodal folder's vision/audio towers are never read.
    Linears are FP8 when the checkpoint is (``quantization_config``) or with ``quantization="fp8"``
    (block-wise at load); ``embedding_dtype="fp8"`` stores the embedding table (and an untied
    lm_head) in FP8 with per-row scales. ``engine/sizing/memory.py`` prices exactly this layout.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"model folder {str(folder)!r} does not exist")
    hf_config = read_hf_config(folder)
    if dtype == "auto":  # bfloat16 where the CPU computes it natively; on CUDA the checkpoint's
        dtype = dtype_for_auto(str(torch.device(device)), folder)
    if embedding_dtype not in ("auto", "fp8"):
        raise ConfigError(f"unknown embedding dtype {embedding_dtype!r}; valid: auto, fp8")
    fmt = weights_format_for(hf_config, quantization)
    if is_gemma4(hf_config):
        if FP8WeightFormat.from_hf(hf_config) is not None or embedding_dtype != "auto":
            raise ConfigError("FP8 Gemma 4 checkpoints and FP8 embeddings are not supported yet"
                              " (--quantization fp8 quantizes a 16/32-bit Gemma 4 at load)")
        return replace(load_gemma4(folder, hf_config, dtype, device, kernels, language_model_only, fmt),
                       hf_config=hf_config)
    return load_qwen3(folder, hf_config, dtype, device, kernels, fmt, embedding_dtype)
