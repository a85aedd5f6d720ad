"""Turn a freshly built (empty) model's layers into FP8 ones before its weights are loaded.

``use_fp8_linears(model, fmt, parts)`` replaces every ``Linear`` whose Hugging Face modules the
format quantizes with an ``FP8Linear`` of the same parts (q/k/v, gate/up keep their own scales);
lm_head stays as it is. ``use_fp8_embedding(model, dtype)`` stores the embedding table (the one
table of a tied model) and an untied lm_head in FP8 with per-row scales. Call both on the
``meta`` device after the model's dtype is set and before ``to_empty``: FP8 buffers must not
go through ``Module.to(dtype)``.
"""

from __future__ import annotations

import torch
from torch import nn

from chatfleet.engine.models.fp8_embedding import FP8Embedding
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import BlockGemm, FP8Linear
from chatfleet.engine.models.linear import Linear
from chatfleet.engine.models.qwen3 import Qwen3ForCausalLM
from chatfleet.engine.models.workspace import Workspace
from chatfleet.errors import ConfigError


def hf_parts(model: Qwen3ForCausalLM, name: str) -> list[tuple[str, int]]:
    """The Hugging Face modules (name, rows) a linear of ours fuses, in row order."""
    cfg = model.config
    prefix, _, leaf = name.rpartition(".")
    hf_prefix = f"model.{prefix}"
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if leaf == "qkv_proj":
        return [(f"{hf_prefix}.q_proj", q), (f"{hf_prefix}.k_proj", kv), (f"{hf_prefix}.v_proj", kv)]
    if leaf == "gate_up_proj":
        return [(f"{hf_prefix}.gate_proj", cfg.intermediate_size), (f"{hf_prefix}.up_proj", cfg.intermediate_size)]
    module: nn.Module = model.get_submodule(name)
    assert isinstance(module, Linear)
    return [(f"{hf_prefix}.{leaf}", module.out_features)]


def use_fp8_linears(model: Qwen3ForCausalLM, fmt: FP8WeightFormat) -> int:
    """Swap quantizable linears for ``FP8Linear``s; returns how many were swapped."""
    swapped = 0
    workspace = Workspace()  # one dequantized weight at a time, shared by this model's layers
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        parts = hf_parts(model, name)
        ignored = [fmt.is_ignored(p) for p, _ in parts]
        if all(ignored):
            continue
        if any(ignored):
            raise ConfigError(f"{name}: the checkpoint quantizes some of {[p for p, _ in parts]} but not all")
        dtype = module.weight.dtype if module.weight is not None else torch.float32
        fp8 = FP8Linear(module.in_features, [n for _, n in parts], fmt, bias=module.bias is not None, dtype=dtype,
                        workspace=workspace)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, fp8)
        swapped += 1
    return swapped


def use_fp8_embedding(model: Qwen3ForCausalLM, dtype: torch.dtype) -> None:
    """Store the embedding table (and an untied lm_head) in FP8 with per-row scales."""
    cfg = model.config
    model.embed_tokens = FP8Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
    if model.lm_head is not None:
        model.lm_head = FP8Embedding(cfg.vocab_size, cfg.hidden_size, dtype)


def use_block_gemm(model: nn.Module, gemm: BlockGemm | None) -> int:
    """Send every block-scaled FP8 linear of ``model`` through ``gemm`` (None: dequantize again);
    returns how many layers take it."""
    layers = [m for m in model.modules() if isinstance(m, FP8Linear) and m.fmt.granularity == "block"]
    for m in layers:
        m.block_gemm = gemm
    return len(layers)

