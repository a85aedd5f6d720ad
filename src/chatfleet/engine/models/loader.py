"""Load a Hugging Face Qwen3 folder: config.json, single or sharded safetensors, tokenizer."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from chatfleet.engine.models.fp8_embedding import FP8Embedding
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import FP8, FP8Linear, dequantize_weight
from chatfleet.engine.models.fp8_model import use_fp8_embedding, use_fp8_linears
from chatfleet.engine.models.gemma4_config import is_gemma4
from chatfleet.engine.models.kv_scales import KVScales, match_kv_scale
from chatfleet.engine.models.linear import resolve_kernel_backend
from chatfleet.engine.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from chatfleet.engine.sizing.memory import weights_format_for
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
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias|weight_scale_inv|weight_scale|input_scale)$")
_SCALE_NAMES = ("weight_scale_inv", "weight_scale")
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


def read_config(path: str | os.PathLike) -> Qwen3Config:
    return Qwen3Config.from_hf(read_hf_config(path))


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


def load_weights(model: Qwen3ForCausalLM, folder: Path, fmt: FP8WeightFormat | None = None) -> KVScales | None:
    """Copy every tensor of the folder into ``model`` (dtype converted), fusing q/k/v and gate/up.

    FP8 tensors of a checkpoint in format ``fmt`` go into ``FP8Linear`` parts with their scales
    (or are dequantized into a 16/32-bit linear the model keeps); 16/32-bit tensors meant for an
    ``FP8Linear`` / ``FP8Embedding`` are quantized on the way in. A tied model skips
    ``lm_head.weight`` (one table). Returns the checkpoint's FP8 KV cache scales, if any.
    """
    cfg = model.config
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    part_sizes = {
        "self_attn.qkv_proj": [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                               cfg.num_kv_heads * cfg.head_dim],
        "mlp.gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size],
    }
    loaded: set[tuple[str, int | None]] = set()
    kv_scales: dict[tuple[int, str], float] = {}
    fp8_weights: dict[tuple[str, int | None], torch.Tensor] = {}  # (our weight name, part) -> e4m3
    fp8_scales: dict[tuple[str, int | None], torch.Tensor] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if _IGNORED_RE.search(hf_name):
                    continue
                kv = match_kv_scale(hf_name)
                if kv is not None:
                    if kv[0] >= 0:  # one scale per layer: the largest, if the checkpoint has per-head ones
                        kv_scales[kv] = float(f.get_tensor(hf_name).float().max())
                    continue
                if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                name, part = _target_name(hf_name)
                module_name, _, attr = name.rpartition(".")
                module = modules.get(module_name)
                if attr in _SCALE_NAMES:
                    fp8_scales[(f"{module_name}.weight", part)] = f.get_tensor(hf_name)
                    continue
                if attr == "input_scale":  # static activation scales: activations are quantized per token
                    continue
                tensor = f.get_tensor(hf_name)
                if tensor.dtype == FP8:  # placed with its scale once every file is read
                    fp8_weights[(name, part)] = tensor
                    continue
                if isinstance(module, FP8Linear) and attr == "weight":  # quantize at load (--quantization fp8)
                    try:
                        with torch.no_grad():
                            module.set_part(part or 0, tensor)
                    except ValueError as e:
                        raise ConfigError(f"{hf_name}: {e}") from None
                    loaded.add((name, part))
                    continue
                if isinstance(module, FP8Embedding) and attr == "weight":
                    module.load(tensor)
                    loaded.add((name, None))
                    continue
                if name not in params:
                    raise ConfigError(f"unexpected weight {hf_name!r} in {file.name} for this config")
                target = params[name]
                if part is not None:
                    kind = next(k for k in part_sizes if k in name)
                    sizes = part_sizes[kind]
                    target = target.narrow(0, sum(sizes[:part]), sizes[part])
                _check_shape(hf_name, tensor, target)
                with torch.no_grad():
                    target.copy_(tensor)
                loaded.add((name, part))
    loaded |= _place_fp8(model, fp8_weights, fp8_scales, fmt, part_sizes)
    expected: set[tuple[str, int | None]] = set()
    for name in params:
        kind = next((k for k in part_sizes if k in name), None)
        if kind is None:
            expected.add((name, None))
        else:
            expected.update((name, i) for i in range(len(part_sizes[kind])))
    for module_name, module in modules.items():
        if isinstance(module, FP8Linear):
            fused = len(module.part_sizes) > 1
            expected.update((f"{module_name}.weight", i if fused else None) for i in range(len(module.part_sizes)))
        elif isinstance(module, FP8Embedding):
            expected.add((f"{module_name}.weight", None))
    missing = sorted(f"{n}[{p}]" if p is not None else n for n, p in expected - loaded)
    if missing:
        raise ConfigError(f"weights missing from {str(folder)!r}: {', '.join(missing[:8])}"
                          + (" ..." if len(missing) > 8 else ""))
    return KVScales.from_checkpoint(kv_scales, cfg.num_layers)


def _check_shape(hf_name: str, tensor: torch.Tensor, target: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise ConfigError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")


def _place_fp8(model: Qwen3ForCausalLM, weights: dict[tuple[str, int | None], torch.Tensor],
               scales: dict[tuple[str, int | None], torch.Tensor], fmt: FP8WeightFormat | None,
               part_sizes: dict[str, list[int]]) -> set[tuple[str, int | None]]:
    """Put FP8 (or to-be-quantized) weights into their modules; returns what was loaded."""
    loaded: set[tuple[str, int | None]] = set()
    params = dict(model.named_parameters())
    for (name, part), w in weights.items():
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        scale = scales.get((name, part))
        if w.dtype == FP8 and scale is None:
            raise ConfigError(f"FP8 weight {name} (part {part}) has no scale tensor in the checkpoint")
        if isinstance(module, FP8Linear):
            try:
                with torch.no_grad():
                    module.set_part(part or 0, w, scale)
            except ValueError as e:
                raise ConfigError(f"{name}: {e}") from None
        else:  # a module the model keeps in 16/32 bits: dequantize into it
            if fmt is None:
                raise ConfigError(f"{name} is FP8 but config.json declares no FP8 quantization_config")
            target = params[name]
            if part is not None:
                sizes = part_sizes[next(k for k in part_sizes if k in name)]
                target = target.narrow(0, sum(sizes[:part]), sizes[part])
            _check_shape(name, w, target)
            with torch.no_grad():
                dequantize_weight(w, scale, fmt, target.dtype, target)
        loaded.add((name, part))
    return loaded


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", kernels: str = "auto",
               language_model_only: bool = True, quantization: str | None = None,
               embedding_dtype: str = "auto") -> LoadedModel:
    """Build the model from ``path`` (an HF Qwen3 or Gemma 4 folder) in ``dtype`` on ``device``.

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
    if embedding_dtype not in ("auto", "fp8"):
        raise ConfigError(f"unknown embedding dtype {embedding_dtype!r}; valid: auto, fp8")
    fmt = weights_format_for(hf_config, quantization)
    if is_gemma4(hf_config):
        from chatfleet.engine.models.gemma4_weights import load_gemma4

        if FP8WeightFormat.from_hf(hf_config) is not None or embedding_dtype != "auto":
            raise ConfigError("FP8 Gemma 4 checkpoints and FP8 embeddings are not supported yet"
                              " (--quantization fp8 quantizes a 16/32-bit Gemma 4 at load)")
        return replace(load_gemma4(folder, hf_config, dtype, device, kernels, language_model_only, fmt),
                       hf_config=hf_config)
    cfg = Qwen3Config.from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype)
    dev = torch.device(device)
    backend = resolve_kernel_backend(kernels, dev, torch_dtype)
    with torch.device("meta"):  # no memory, no init: set the dtype first, then place
        model = Qwen3ForCausalLM(cfg).to(torch_dtype)
        if fmt is not None:  # FP8 modules after .to(dtype), which would convert their buffers
            use_fp8_linears(model, fmt)
        if embedding_dtype == "fp8":
            use_fp8_embedding(model, torch_dtype)
    model = model.to_empty(device=dev)
    kv_scales = load_weights(model, folder, FP8WeightFormat.from_hf(hf_config))
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
        kv_scales=kv_scales,
        hf_config=hf_config,
    )
