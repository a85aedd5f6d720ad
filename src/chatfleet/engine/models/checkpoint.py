"""A model folder on disk and what loading it gives: config.json, safetensors files, dtype
names, and ``LoadedModel`` (the model, its config and tokenizer, ready to run).

``loader.load_model`` picks the architecture; ``qwen3_weights.py`` and ``gemma4_weights.py``
read a checkpoint's tensors into their model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatfleet.engine.models.kv_scales import KVScales
from chatfleet.engine.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, with everything the engine needs to know about it.

    ``model``/``config``: Qwen3 here, or Gemma 4 (``gemma4.py``, loaded by ``gemma4_weights.py``);
    both offer the same calls (``model(...)``, ``compute_logits``, ``config.kv_cache_spec``).
    """

    model: Qwen3ForCausalLM | Any
    config: Qwen3Config | Any
    tokenizer: ChatTokenizer
    path: Path
    dtype: torch.dtype
    device: torch.device
    kernels: str = "torch"  # the resolved kernel backend: "onednn" or "torch"
    weight_report: Any = None  # Gemma 4: gemma4_weights.WeightLoadReport (bytes read / left on disk)
    kv_scales: KVScales | None = None  # FP8 KV cache scales found in the checkpoint
    hf_config: Mapping[str, Any] = field(default_factory=dict)  # config.json as read

    @property
    def max_model_len(self) -> int:
        return self.config.max_position_embeddings


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ConfigError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}") from None


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """A model folder's config.json as a dict."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{str(path)!r} has no config.json")
    with cfg_file.open(encoding="utf-8") as f:
        return json.load(f)


def weight_files(folder: Path) -> list[Path]:
    """A folder's safetensors files: those its index names, else model.safetensors, else all."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{str(folder)!r} has no .safetensors weights")
    return files
