"""Qwen3 weights from a Hugging Face folder (single or sharded safetensors) into
``Qwen3ForCausalLM``: q/k/v and gate/up fused, FP8 tensors with their scales (or quantized or
dequantized on the way in), the checkpoint's FP8 KV cache scales.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from chatfleet.engine.models.checkpoint import LoadedModel, read_hf_config, resolve_dtype, weight_files
from chatfleet.engine.models.fp8_embedding import FP8Embedding
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import FP8, FP8Linear, dequantize_weight
from chatfleet.engine.models.fp8_model import use_fp8_embedding, use_fp8_linears
from chatfleet.engine.models.kv_scales import KVScales, match_kv_scale
from chatfleet.engine.models.linear import resolve_kernel_backend
from chatfleet.engine.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.errors import ConfigError

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


def read_config(path: str | os.PathLike) -> Qwen3Config:
    return Qwen3Config.from_hf(read_hf_config(path))


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
                target: torch.Tensor = params[name]
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
        fused_kind = next((k for k in part_sizes if k in name), None)
        if fused_kind is None:
            expected.add((name, None))
        else:
            expected.update((name, i) for i in range(len(part_sizes[fused_kind])))
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
            target: torch.Tensor = params[name]
            if part is not None:
                sizes = part_sizes[next(k for k in part_sizes if k in name)]
                target = target.narrow(0, sum(sizes[:part]), sizes[part])
            _check_shape(name, w, target)
            assert scale is not None  # every weight here is FP8, and one without a scale was refused above
            with torch.no_grad():
                dequantize_weight(w, scale, fmt, target.dtype, target)
        loaded.add((name, part))
    return loaded


def load_qwen3(folder: Path, hf_config: dict[str, Any], dtype: str | torch.dtype, device: str | torch.device,
               kernels: str, fmt: FP8WeightFormat | None, embedding_dtype: str) -> LoadedModel:
    """A Qwen3 folder as a ``LoadedModel`` (see ``loader.load_model`` for the arguments)."""
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
