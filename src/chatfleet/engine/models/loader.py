"""Load a Hugging Face Qwen3 folder: config.json, single or sharded safetensors, tokenizer."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from chatfleet.engine.models.gemma4_config import is_gemma4
from chatfleet.engine.models.linear import resolve_kernel_backend
from chatfleet.engine.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# HF name fragment -> (our fused parameter, index of the part inside it)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_IGNORED_RE = re.compile(r"rotary_emb\.inv_freq$")


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


def read_config(path: str | os.PathLike) -> Qwen3Config:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{str(path)!r} has no config.json")
    with cfg_file.open(encoding="utf-8") as f:
        return Qwen3Config.from_hf(json.load(f))


def _weight_files(folder: Path) -> list[Path]:
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


def _target_name(hf_name: str) -> tuple[str, int | None]:
    """Our parameter name for an HF one, and the part index when it is fused."""
    m = _LAYER_RE.match(hf_name)
    if m:
        layer, module, kind = m.groups()
        if module in _FUSED:
            fused, part = _FUSED[module]
            return f"layers.{layer}.{fused}.{kind}", part
        return f"layers.{layer}.{module}.{kind}", None
    if hf_name.startswith("model."):
        return hf_name[len("model."):], None
    return hf_name, None  # lm_head.weight


def load_weights(model: Qwen3ForCausalLM, folder: Path) -> None:
    """Copy every tensor of the folder into ``model`` (dtype converted), fusing q/k/v and gate/up."""
    cfg = model.config
    params = dict(model.named_parameters())
    part_sizes = {
        "self_attn.qkv_proj": [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                               cfg.num_kv_heads * cfg.head_dim],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    loaded: set[tuple[str, int | None]] = set()
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if _IGNORED_RE.search(hf_name):
                    continue
                if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                name, part = _target_name(hf_name)
                if name not in params:
                    raise ConfigError(f"unexpected weight {hf_name!r} in {file.name} for this config")
                target = params[name]
                if part is not None:
                    kind = next(k for k in part_sizes if k in name)
                    sizes = part_sizes[kind]
                    target = target.narrow(0, sum(sizes[:part]), sizes[part])
                tensor = f.get_tensor(hf_name)
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ConfigError(
                        f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor)
                loaded.add((name, part))
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        kind = next((k for k in part_sizes if k in name), None)
        if kind is None:
            expected.add((name, None))
        else:
            expected.update((name, i) for i in range(len(part_sizes[kind])))
    missing = sorted(f"{n}[{p}]" if p is not None else n for n, p in expected - loaded)
    if missing:
        raise ConfigError(f"weights missing from {str(folder)!r}: {', '.join(missing[:8])}"
                          + (" ..." if len(missing) > 8 else ""))


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", kernels: str = "auto",
               language_model_only: bool = True) -> LoadedModel:
    """Build the model from ``path`` (an HF Qwen3 or Gemma 4 folder) in ``dtype`` on ``device``.

    ``kernels``: ``auto`` (oneDNN on CPU where available), ``onednn`` or ``torch``; see linear.py.
    ``language_model_only``: a multimodal folder's vision/audio towers are never read.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"model folder {str(folder)!r} does not exist")
    if (folder / "config.json").is_file():
        hf_config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if is_gemma4(hf_config):
            from chatfleet.engine.models.gemma4_weights import load_gemma4

            return load_gemma4(folder, hf_config, dtype, device, kernels, language_model_only)
    cfg = read_config(folder)
    torch_dtype = resolve_dtype(dtype)
    dev = torch.device(device)
    backend = resolve_kernel_backend(kernels, dev, torch_dtype)
    with torch.device("meta"):  # no memory, no init: set the dtype first, then place
        model = Qwen3ForCausalLM(cfg).to(torch_dtype)
    model = model.to_empty(device=dev)
    load_weights(model, folder)
    model.eval().requires_grad_(False)
    model.use_kernels(backend)
    model.init_rotary()
    return LoadedModel(
        model=model,
        config=cfg,
        tokenizer=ChatTokenizer.from_pretrained(folder),
        path=folder,
        dtype=torch_dtype,
        device=dev,
        kernels=backend,
    )
