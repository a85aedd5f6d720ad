"""Small Gemma 4 models with seeded random weights, laid out like the real checkpoints.

``build_tiny_gemma4(out, size, moe=, multimodal=, seed=)`` writes a Hugging Face folder that
``transformers`` (``Gemma4ForCausalLM`` / ``Gemma4ForConditionalGeneration``) and chatfleet load:
the 26B-A4B's fields and layer pattern shrunk (five sliding-window layers to one full-attention
layer, full layers with their own larger head dim and fewer KV heads taking V from K
(``attention_k_eq_v``), a tied embedding, final-logit soft-capping, and with ``moe`` the MoE block
beside the dense MLP). ``multimodal`` wraps the text model as the real checkpoint does
(``model.language_model.*``) and adds a vision tower and its embedder (the 26B-A4B has no
audio tower). The tokenizer and ChatML template are the Qwen3 tiny models' (``chatml.py``).

Named models (``resolve_model``): ``{tiny,small}-gemma4[-moe][-mm]``. The dense and MoE variants
of one size have the same active feed-forward width (dense ``intermediate_size`` == MoE
``intermediate_size + top_k * moe_intermediate_size``), so they compare MoE against a dense
model of the same active parameters.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from chatfleet.engine.builtin_models.chatml import ENDOFTEXT, IM_END, write_chat_files, write_chat_tokenizer, write_json
from chatfleet.errors import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"
NAME_RE = re.compile(r"^(tiny|small)-gemma4(-moe)?(-mm)?$")


@dataclass(frozen=True)
class VisionSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    patch_size: int = 16
    position_embedding_size: int = 1024
    pooling_kernel_size: int = 3


@dataclass(frozen=True)
class Gemma4TinySpec:
    vocab_size: int  # BPE target
    hidden_size: int
    dense_intermediate_size: int  # the dense variant's MLP == the MoE variant's active width
    num_layers: int  # every sixth layer (and the last) is full attention
    num_heads: int
    num_kv_heads: int
    head_dim: int
    global_head_dim: int
    num_global_kv_heads: int
    sliding_window: int
    moe_intermediate_size: int  # MoE variant: per expert
    num_experts: int
    top_k_experts: int
    vision: VisionSpec
    max_position_embeddings: int = 32768
    final_logit_softcapping: float = 30.0
    embed_std: float = 0.02
    proj_std: float = 0.08

    @property
    def moe_dense_intermediate_size(self) -> int:
        """The MoE variant's always-on MLP: what the routed experts leave of the active width."""
        return self.dense_intermediate_size - self.top_k_experts * self.moe_intermediate_size

    @property
    def layer_types(self) -> list[str]:
        kinds = [SLIDING if (i + 1) % 6 else FULL for i in range(self.num_layers)]
        kinds[-1] = FULL
        return kinds


SIZES: dict[str, Gemma4TinySpec] = {
    "tiny": Gemma4TinySpec(
        vocab_size=4096, hidden_size=64, dense_intermediate_size=256, num_layers=6, num_heads=4,
        num_kv_heads=2, head_dim=16, global_head_dim=32, num_global_kv_heads=1, sliding_window=64,
        moe_intermediate_size=64, num_experts=8, top_k_experts=2,
        vision=VisionSpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, head_dim=16,
                          patch_size=8, position_embedding_size=64),
    ),
    "small": Gemma4TinySpec(
        vocab_size=8192, hidden_size=512, dense_intermediate_size=2048, num_layers=12, num_heads=8,
        num_kv_heads=4, head_dim=64, global_head_dim=128, num_global_kv_heads=2, sliding_window=512,
        moe_intermediate_size=256, num_experts=16, top_k_experts=4, proj_std=0.04,
        vision=VisionSpec(hidden_size=384, intermediate_size=1536, num_layers=6, num_heads=6, head_dim=64),
    ),
}


def is_gemma4_name(name: str) -> bool:
    return NAME_RE.match(name) is not None


def text_config(spec: Gemma4TinySpec, vocab: int, token_ids: dict[str, int], moe: bool) -> dict:
    cfg = {
        "model_type": "gemma4_text",
        "vocab_size": vocab,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.moe_dense_intermediate_size if moe else spec.dense_intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "global_head_dim": spec.global_head_dim,
        "num_global_key_value_heads": spec.num_global_kv_heads,
        "attention_k_eq_v": True,
        "layer_types": spec.layer_types,
        "sliding_window": spec.sliding_window,
        "rope_parameters": {
            SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
            FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
        },
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": spec.final_logit_softcapping,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "enable_moe_block": moe,
        "num_experts": spec.num_experts if moe else None,
        "top_k_experts": spec.top_k_experts if moe else None,
        "moe_intermediate_size": spec.moe_intermediate_size if moe else None,
        "initializer_range": spec.embed_std,
        "pad_token_id": token_ids[ENDOFTEXT],
        "bos_token_id": token_ids[ENDOFTEXT],
        "eos_token_id": token_ids[IM_END],
        "dtype": "float32",
    }
    return cfg


def vision_config(v: VisionSpec) -> dict:
    return {
        "model_type": "gemma4_vision", "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
        "num_hidden_layers": v.num_layers, "num_attention_heads": v.num_heads, "num_key_value_heads": v.num_heads,
        "head_dim": v.head_dim, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
        "patch_size": v.patch_size, "position_embedding_size": v.position_embedding_size,
        "pooling_kernel_size": v.pooling_kernel_size, "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
        "standardize": False, "use_clipped_linears": False, "attention_bias": False,
    }


class _Weights:
    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def normal(self, name: str, shape: tuple[int, ...], std: float) -> None:
        self.tensors[name] = torch.randn(shape, generator=self.gen) * std

    def ones(self, name: str, shape: tuple[int, ...]) -> None:
        self.tensors[name] = torch.ones(shape)


def _text_weights(w: _Weights, spec: Gemma4TinySpec, vocab: int, moe: bool, prefix: str) -> None:
    h, std = spec.hidden_size, spec.proj_std
    inter = spec.moe_dense_intermediate_size if moe else spec.dense_intermediate_size
    w.normal(prefix + "embed_tokens.weight", (vocab, h), spec.embed_std)
    for i, kind in enumerate(spec.layer_types):
        p = f"{prefix}layers.{i}."
        full = kind == FULL
        d = spec.global_head_dim if full else spec.head_dim
        kv = (spec.num_global_kv_heads if full else spec.num_kv_heads) * d
        w.ones(p + "layer_scalar", (1,))
        w.normal(p + "self_attn.q_proj.weight", (spec.num_heads * d, h), std)
        w.normal(p + "self_attn.k_proj.weight", (kv, h), std)
        if not full:  # attention_k_eq_v: full layers take V from K
            w.normal(p + "self_attn.v_proj.weight", (kv, h), std)
        w.normal(p + "self_attn.o_proj.weight", (h, spec.num_heads * d), std)
        w.ones(p + "self_attn.q_norm.weight", (d,))
        w.ones(p + "self_attn.k_norm.weight", (d,))
        w.normal(p + "mlp.gate_proj.weight", (inter, h), std)
        w.normal(p + "mlp.up_proj.weight", (inter, h), std)
        w.normal(p + "mlp.down_proj.weight", (h, inter), std)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            w.ones(p + norm + ".weight", (h,))
        if moe:
            e, m = spec.num_experts, spec.moe_intermediate_size
            w.ones(p + "router.scale", (h,))
            w.ones(p + "router.per_expert_scale", (e,))
            w.normal(p + "router.proj.weight", (e, h), std)
            w.normal(p + "experts.gate_up_proj", (e, 2 * m, h), std)
            w.normal(p + "experts.down_proj", (e, h, m), std)
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                w.ones(p + norm + ".weight", (h,))
    w.ones(prefix + "norm.weight", (h,))


def _vision_weights(w: _Weights, v: VisionSpec, text_hidden: int) -> None:
    p, h = "model.vision_tower.", v.hidden_size
    w.ones(p + "patch_embedder.position_embedding_table", (2, v.position_embedding_size, h))
    w.normal(p + "patch_embedder.input_proj.weight", (h, 3 * v.patch_size**2), 0.02)
    for i in range(v.num_layers):
        q = f"{p}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            w.normal(q + f"self_attn.{proj}.linear.weight", (v.num_heads * v.head_dim, h), 0.02)
        w.normal(q + "self_attn.o_proj.linear.weight", (h, v.num_heads * v.head_dim), 0.02)
        w.ones(q + "self_attn.q_norm.weight", (v.head_dim,))
        w.ones(q + "self_attn.k_norm.weight", (v.head_dim,))
        w.normal(q + "mlp.gate_proj.linear.weight", (v.intermediate_size, h), 0.02)
        w.normal(q + "mlp.up_proj.linear.weight", (v.intermediate_size, h), 0.02)
        w.normal(q + "mlp.down_proj.linear.weight", (h, v.intermediate_size), 0.02)
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            w.ones(q + norm + ".weight", (h,))
    w.normal("model.embed_vision.embedding_projection.weight", (text_hidden, h), 0.02)


def build_tiny_gemma4(out_dir: str | os.PathLike, size: str = "tiny", *, moe: bool = False,
                      multimodal: bool = False, seed: int = 0) -> Path:
    """Write a Gemma 4 model of ``size`` (``tiny``/``small``) into ``out_dir``."""
    try:
        spec = SIZES[size]
    except KeyError:
        raise ConfigError(f"unknown Gemma 4 tiny size {size!r}; valid sizes: {', '.join(SIZES)}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, token_ids = write_chat_tokenizer(out, spec.vocab_size)
    w = _Weights(seed)
    text = text_config(spec, vocab, token_ids, moe)
    if multimodal:
        _text_weights(w, spec, vocab, moe, "model.language_model.")
        _vision_weights(w, spec.vision, spec.hidden_size)
        config = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
                  "text_config": text, "vision_config": vision_config(spec.vision), "audio_config": None,
                  "tie_word_embeddings": True, "dtype": "float32"}
    else:
        _text_weights(w, spec, vocab, moe, "model.")
        config = {"architectures": ["Gemma4ForCausalLM"], **text}
    save_file(w.tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_json(out / "config.json", config)
    write_chat_files(out, token_ids, spec.max_position_embeddings)
    return out


def build_named(name: str, out_dir: str | os.PathLike, seed: int = 0) -> Path:
    """Build ``{tiny,small}-gemma4[-moe][-mm]``."""
    m = NAME_RE.match(name)
    if m is None:
        raise ConfigError(f"not a Gemma 4 tiny model name: {name!r}")
    return build_tiny_gemma4(out_dir, m.group(1), moe=bool(m.group(2)), multimodal=bool(m.group(3)), seed=seed)
