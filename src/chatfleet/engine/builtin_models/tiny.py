"""Build small Qwen3-architecture models with seeded random weights, for tests and demos.

``build_tiny_model(out_dir, size, seed)`` writes a normal Hugging Face folder (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML template,
generation_config.json) that ``transformers``, vLLM and chatfleet all load.
``resolve_model("tiny" | "small" | path)`` builds the named sizes (and ``tiny_gemma4``'s) once
into a cache folder. The tokenizer and chat files come from ``chatml.py``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from chatfleet.engine.builtin_models.chatml import ENDOFTEXT, IM_END, write_chat_files, write_chat_tokenizer, write_json
from chatfleet.engine.builtin_models.fp8 import FP8_SUFFIX, to_fp8_checkpoint
from chatfleet.engine.builtin_models.tiny_gemma4 import build_named, is_gemma4_name
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.errors import ConfigError

CACHE_VERSION = "v2"  # v2: the chat template renders tools and tool calls
@dataclass(frozen=True)
class TinySpec:
    """Shape of one built-in model size."""

    vocab_size: int  # BPE target; the trained vocabulary may come out smaller
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    rope_theta: float = 1_000_000.0
    embed_std: float = 0.02
    proj_std: float = 0.08  # larger than HF's 0.02 so layers, not the residual, drive the output


SIZES: dict[str, TinySpec] = {
    # ~1.4 M parameters; head_dim (48) != hidden/heads (32); GQA 2:1; tied embeddings.
    "tiny": TinySpec(
        vocab_size=4096, hidden_size=128, intermediate_size=384, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=48, tie_word_embeddings=True,
    ),
    # ~30 M parameters; GQA 4:1; untied embeddings.
    "small": TinySpec(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_layers=8,
        num_heads=8, num_kv_heads=2, head_dim=64, tie_word_embeddings=False,
        proj_std=0.04,
    ),
}


def get_spec(size: str) -> TinySpec:
    try:
        return SIZES[size]
    except KeyError:
        raise ConfigError(f"unknown tiny model size {size!r}; valid sizes: {', '.join(SIZES)}") from None


def _random_weights(spec: TinySpec, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """HF Qwen3 parameter names -> seeded random float32 tensors, generated in a fixed order."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape: tuple[int, ...], std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal((vocab, h), spec.embed_std)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
        w[p + "self_attn.q_proj.weight"] = normal((q, h), spec.proj_std)
        w[p + "self_attn.k_proj.weight"] = normal((kv, h), spec.proj_std)
        w[p + "self_attn.v_proj.weight"] = normal((kv, h), spec.proj_std)
        w[p + "self_attn.o_proj.weight"] = normal((h, q), spec.proj_std)
        w[p + "self_attn.q_norm.weight"] = torch.ones(spec.head_dim)
        w[p + "self_attn.k_norm.weight"] = torch.ones(spec.head_dim)
        w[p + "mlp.gate_proj.weight"] = normal((spec.intermediate_size, h), spec.proj_std)
        w[p + "mlp.up_proj.weight"] = normal((spec.intermediate_size, h), spec.proj_std)
        w[p + "mlp.down_proj.weight"] = normal((h, spec.intermediate_size), spec.proj_std)
    w["model.norm.weight"] = torch.ones(h)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = normal((vocab, h), spec.embed_std)
    return w


def _config(spec: TinySpec, vocab: int, token_ids: dict[str, int]) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "initializer_range": spec.embed_std,
        "bos_token_id": token_ids[ENDOFTEXT],
        "eos_token_id": token_ids[IM_END],
        "torch_dtype": "float32",
        "use_cache": True,
    }


def build_tiny_model(out_dir: str | os.PathLike, size: str = "tiny", seed: int = 0,
                     fp8: FP8WeightFormat | None = None) -> Path:
    """Write a Qwen3 model of ``size`` with weights seeded by ``seed`` into ``out_dir``.

    ``fp8``: write the same weights as an FP8 checkpoint in that format (``models/fp8.py``).
    """
    spec = get_spec(size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, token_ids = write_chat_tokenizer(out, spec.vocab_size)
    weights = _random_weights(spec, vocab, seed)
    config = _config(spec, vocab, token_ids)
    if fp8 is not None:
        weights = to_fp8_checkpoint(weights, fp8)
        config.update(torch_dtype="bfloat16", quantization_config=fp8.to_hf())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)
    write_chat_files(out, token_ids, spec.max_position_embeddings)
    return out


def cache_root() -> Path:
    """``$CHATFLEET_CACHE`` or ``~/.cache/chatfleet``."""
    env = os.environ.get("CHATFLEET_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "chatfleet"


def builtin_names() -> list[str]:
    """Names ``resolve_model`` builds: each size, each size as an FP8 checkpoint, and Gemma 4
    (``tiny_gemma4``: ``{tiny,small}-gemma4[-moe][-mm]``)."""
    return [*SIZES, *(f"{s}{FP8_SUFFIX}" for s in SIZES)]


def _named_builder(name: str) -> Callable[[Path], Path] | None:
    """How to build a built-in model name, else None."""
    if name in builtin_names():
        size = name.removesuffix(FP8_SUFFIX)
        return lambda out: build_tiny_model(out, size=size, seed=0,
                                            fp8=FP8WeightFormat() if name != size else None)
    if is_gemma4_name(name):
        return lambda out: build_named(name, out, seed=0)
    return None


def resolve_model(name_or_path: str | os.PathLike) -> Path:
    """A built-in name (``tiny``, ``small``, ``tiny-fp8``, ``tiny-gemma4``, ``small-gemma4-moe``, ...):
    build once into the cache (safe across processes); else a local folder."""
    name = str(name_or_path)
    builder = _named_builder(name)
    if builder is not None:
        target = cache_root() / "models" / f"{name}-{CACHE_VERSION}"
        if (target / "config.json").is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        try:
            builder(tmp)
            try:
                os.rename(tmp, target)  # atomic; loses harmlessly to a concurrent builder
            except OSError:
                if not (target / "config.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {name!r} is not a local folder; use a Hugging Face model folder or one of: "
            f"{', '.join(builtin_names())}, {{tiny,small}}-gemma4[-moe][-mm]"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model folder {str(path)!r} has no config.json")
    return path

