"""Load a Gemma 4 checkpoint's text model into ``Gemma4ForCausalLM``, tensor by tensor.

Checkpoint names (``transformers`` 5.x) map onto ours: q/k/v into ``qkv_proj`` (q/k only with
``attention_k_eq_v`` on full layers; q alone on KV-sharing layers), gate/up into
``gate_up_proj``, and the MoE block's 3-D ``experts.gate_up_proj`` [E, 2I, H] /
``experts.down_proj`` [E, H, I] into one ``Linear`` pair per expert (``moe.py``).

``language_model_only``: tensors of a ``Gemma4ForConditionalGeneration`` folder outside the
language model (vision and audio towers, their embedders) are never read: safetensors reads by
name, and only their sizes (from the file header) are summed into ``WeightLoadReport``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from chatfleet.engine.models.checkpoint import LoadedModel, resolve_dtype, weight_files
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import FP8Linear
from chatfleet.engine.models.gemma4 import Gemma4DecoderLayer, Gemma4ForCausalLM
from chatfleet.engine.models.gemma4_config import Gemma4Config
from chatfleet.engine.models.linear import Linear, resolve_kernel_backend
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.errors import ConfigError

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I8": 1,
                "U8": 1, "BOOL": 1, "F64": 8, "I16": 2}


@dataclass(frozen=True)
class WeightLoadReport:
    """What a load read and what it left on disk."""

    loaded_bytes: int  # checkpoint bytes read into the model
    skipped_bytes: int  # tower tensors never read (language-model-only)
    skipped_tensors: int
    skipped_prefixes: tuple[str, ...] = field(default=())  # e.g. ("model.vision_tower", ...)

    def describe(self) -> str:
        if not self.skipped_tensors:
            return f"weights: {self.loaded_bytes / 2**20:.1f} MiB read"
        return (f"weights: {self.loaded_bytes / 2**20:.1f} MiB read; language model only: "
                f"{self.skipped_tensors} tensors ({self.skipped_bytes / 2**20:.1f} MiB) of "
                f"{', '.join(self.skipped_prefixes)} not read")


def _tower_prefix(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "model" else parts[0]


def _decoder_layer(model: Gemma4ForCausalLM, index: int) -> Gemma4DecoderLayer:
    """``model.layers[index]`` with its type (a ModuleList gives back a plain Module)."""
    layer = model.layers[index]
    assert isinstance(layer, Gemma4DecoderLayer)
    return layer


class _Targets:
    """Our parameters, and which parts of fused ones have been filled."""

    def __init__(self, model: Gemma4ForCausalLM) -> None:
        self.model = model
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        self.loaded: set[str] = set()

    def copy(self, name: str, tensor: torch.Tensor, rows: tuple[int, int] | None = None,
             hf_name: str = "") -> None:
        target: torch.Tensor | None = self.params.get(name)
        if target is None:
            raise ConfigError(f"unexpected weight {hf_name or name!r} for this config")
        key = name
        if rows is not None:
            target = target.narrow(0, rows[0], rows[1] - rows[0])
            key = f"{name}[{rows[0]}:{rows[1]}]"
        if tuple(tensor.shape) != tuple(target.shape):
            raise ConfigError(f"weight {hf_name or name!r} has shape {tuple(tensor.shape)},"
                              f" expected {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        self.loaded.add(key)

    def expected(self) -> set[str]:
        keys: set[str] = set()
        for name in self.params:
            parts = self._fused_rows(name)
            keys.update([name] if parts is None else [f"{name}[{a}:{b}]" for a, b in parts])
        return keys

    def _fused_rows(self, name: str) -> list[tuple[int, int]] | None:
        bits = name.split(".")
        if len(bits) >= 4 and bits[0] == "layers" and bits[2:4] == ["self_attn", "qkv_proj"]:
            sizes = _decoder_layer(self.model, int(bits[1])).self_attn.qkv_part_sizes()
        elif len(bits) >= 4 and bits[0] == "layers" and bits[2:4] == ["mlp", "gate_up_proj"]:
            inter = _decoder_layer(self.model, int(bits[1])).mlp.intermediate_size
            sizes = [inter, inter]
        else:
            return None
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        return list(zip(bounds[:-1], bounds[1:], strict=True))

    def fused_rows(self, name: str, part: int) -> tuple[int, int]:
        rows = self._fused_rows(name)
        assert rows is not None
        if part >= len(rows):
            raise ConfigError(f"{name}: the checkpoint has a projection this layer does not use")
        return rows[part]


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _load_text_tensor(t: _Targets, local: str, tensor: torch.Tensor, hf_name: str) -> None:
    """``local``: the name inside the text model (``layers.3.self_attn.q_proj.weight``, ...)."""
    bits = local.split(".")
    if bits[0] == "layers" and len(bits) >= 4:
        layer, module = int(bits[1]), bits[2]
        attn = _decoder_layer(t.model, layer).self_attn if layer < len(t.model.layers) else None
        if module == "self_attn" and bits[3] in _QKV and attn is not None:
            if attn.shared:
                if bits[3] != "q_proj":
                    return  # KV-sharing layers' k/v are unused (transformers drops them too)
                t.copy(local, tensor, hf_name=hf_name)
                return
            fused = f"layers.{layer}.self_attn.qkv_proj.{bits[4]}"
            t.copy(fused, tensor, t.fused_rows(fused, _QKV[bits[3]]), hf_name)
            return
        if module == "self_attn" and bits[3] in ("k_norm", "v_norm") and attn is not None and attn.shared:
            return
        if module == "mlp" and bits[3] in _GATE_UP:
            fused = f"layers.{layer}.mlp.gate_up_proj.{bits[4]}"
            t.copy(fused, tensor, t.fused_rows(fused, _GATE_UP[bits[3]]), hf_name)
            return
        if module == "experts" and bits[3] in ("gate_up_proj", "down_proj") and len(bits) == 4:
            for e in range(tensor.shape[0]):
                t.copy(f"layers.{layer}.experts.experts.{e}.{bits[3]}.weight", tensor[e], hf_name=hf_name)
            return
    t.copy(local, tensor, hf_name=hf_name)


def load_gemma4_weights(model: Gemma4ForCausalLM, folder: Path, *, language_model_only: bool = True
                        ) -> WeightLoadReport:
    """Copy the text model's tensors of ``folder`` into ``model``; never read tower tensors."""
    cfg = model.config
    prefix = cfg.weight_prefix
    targets = _Targets(model)
    loaded_bytes = skipped_bytes = skipped = 0
    skipped_prefixes: list[str] = []
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if hf_name == "lm_head.weight" or hf_name.startswith(prefix):
                    if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue
                    if hf_name.endswith("rotary_emb.inv_freq"):
                        continue
                    tensor = f.get_tensor(hf_name)
                    loaded_bytes += tensor.numel() * tensor.element_size()
                    local = hf_name if hf_name == "lm_head.weight" else hf_name[len(prefix):]
                    _load_text_tensor(targets, local, tensor, hf_name)
                elif cfg.multimodal and hf_name.startswith("model."):
                    if not language_model_only:
                        raise ConfigError("serving image or audio input is not supported; "
                                          "load the language model only")
                    sl = f.get_slice(hf_name)  # header only: no tensor data is read
                    numel = 1
                    for d in sl.get_shape():
                        numel *= d
                    skipped_bytes += numel * _DTYPE_BYTES.get(sl.get_dtype(), 4)
                    skipped += 1
                    p = _tower_prefix(hf_name)
                    if p not in skipped_prefixes:
                        skipped_prefixes.append(p)
                else:
                    raise ConfigError(f"unexpected weight {hf_name!r} in {file.name} for a Gemma 4 model")
    missing = sorted(targets.expected() - targets.loaded)
    if missing:
        raise ConfigError(f"weights missing from {str(folder)!r}: {', '.join(missing[:8])}"
                          + (" ..." if len(missing) > 8 else ""))
    return WeightLoadReport(loaded_bytes, skipped_bytes, skipped, tuple(skipped_prefixes))


def _fp8_part_sizes(model: Gemma4ForCausalLM, name: str, module: Linear) -> list[int]:
    """The separately scaled parts of a linear: q/k(/v) and gate/up as the checkpoint has them;
    an expert's ``gate_up_proj`` is one checkpoint tensor (one scale grid)."""
    leaf = name.rpartition(".")[2]
    if leaf == "qkv_proj":
        return _decoder_layer(model, int(name.split(".")[1])).self_attn.qkv_part_sizes()
    if leaf == "gate_up_proj" and ".mlp." in name:
        half = module.out_features // 2
        return [half, half]
    return [module.out_features]


def quantize_linears_fp8(model: Gemma4ForCausalLM, fmt: FP8WeightFormat) -> int:
    """Replace every loaded ``Linear`` (attention, MLP, router, each expert; not lm_head) by an
    ``FP8Linear`` holding its weight quantized with ``fmt``'s scales; returns how many."""
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name == "lm_head" or fmt.is_ignored(name):
            continue
        assert module.weight is not None
        sizes = _fp8_part_sizes(model, name, module)
        fp8 = FP8Linear(module.in_features, sizes, fmt, bias=module.bias is not None, dtype=module.weight.dtype)
        fp8 = fp8.to(module.weight.device)
        row = 0
        with torch.no_grad():
            for i, n in enumerate(sizes):
                fp8.set_part(i, module.weight[row : row + n].float())
                row += n
            if module.bias is not None:
                assert fp8.bias is not None  # built with bias=True just above
                fp8.bias.copy_(module.bias)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, fp8)
        swapped += 1
    return swapped


def load_gemma4(folder: Path, hf_config: dict, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", kernels: str = "auto",
                language_model_only: bool = True, fp8: FP8WeightFormat | None = None) -> LoadedModel:
    """Build a Gemma 4 text model from ``folder`` (see ``loader.load_model``).

    ``fp8``: quantize every linear (experts included) block-wise after loading (``--quantization
    fp8``); FP8 checkpoints of Gemma 4 are not read yet."""
    cfg = Gemma4Config.from_hf(hf_config)
    torch_dtype = resolve_dtype(dtype)
    dev = torch.device(device)
    backend = resolve_kernel_backend(kernels, dev, torch_dtype)
    with torch.device("meta"):  # no memory, no init: set the dtype first, then place
        model = Gemma4ForCausalLM(cfg).to(torch_dtype)
    model = model.to_empty(device=dev)
    report = load_gemma4_weights(model, folder, language_model_only=language_model_only)
    log.info("%s", report.describe())
    model.eval().requires_grad_(False)
    if fp8 is not None:
        log.info("FP8 (quantized at load): %d linears", quantize_linears_fp8(model, fp8))
    model.use_kernels(backend)
    model.init_rotary()
    return LoadedModel(model=model, config=cfg, tokenizer=ChatTokenizer.from_pretrained(folder), path=folder,
                       dtype=torch_dtype, device=dev, kernels=backend, weight_report=report)
