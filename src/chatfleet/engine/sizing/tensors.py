"""A model's tensors by shape and class, from its config.json alone (no torch, no weights).

A ``ModelShape`` lists every weight tensor the model holds (its Hugging Face name, tensor class,
shape and kind) and its KV cache spec (``engine/kv/spec.py``); ``memory.py`` prices it in bytes
for a precision.

Extension point: a new architecture is one *config reader*, a function
``(config dict, block_size) -> ModelShape`` listed under its ``model_type`` in
``config_readers.py`` (``readers.py``, ``gemma4_reader.py`` hold the built-in ones). The reader
lists its tensors with the classes below and builds its KV spec (``spec_from_layer_kinds``
covers sliding/full layer types, ``kv_tensors=1`` for layers whose V is their K,
``shared_kv_layers`` for layers that reuse another layer's KV). MoE experts are one ``linear``
tensor of shape ``[num_experts, out, in]`` in class ``experts``: leading dimensions count as
separate matrices for FP8 scales. Multimodal configs (a
``text_config`` beside ``vision_config`` / ``audio_config``) need no reader of their own: the
text model's reader runs on ``text_config`` and the towers are estimated as ViT-style encoders
(``encoder_estimate``), or a reader listed for the top-level ``model_type`` does it all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from chatfleet.engine.kv.spec import KVCacheSpec
from chatfleet.errors import ConfigError

# Tensor classes, in the order the breakdown lists them.
TENSOR_CLASSES = ("attention", "mlp", "experts", "embedding", "lm_head", "norms", "vision", "audio")
TOWER_CLASSES = ("vision", "audio")  # skipped when serving the language model only
KINDS = ("linear", "embedding", "vector")


@dataclass(frozen=True)
class TensorShape:
    """One weight tensor. ``linear``: ``[..., out, in]`` (FP8-quantizable; leading dims are
    separate matrices, e.g. experts); ``embedding``: ``[rows, dim]`` (FP8 only with per-row
    scales); ``vector``: norms and biases (never quantized)."""

    name: str
    tensor_class: str
    shape: tuple[int, ...]
    kind: str = "linear"

    def __post_init__(self) -> None:
        if self.tensor_class not in TENSOR_CLASSES:
            raise ConfigError(f"tensor {self.name}: unknown class {self.tensor_class!r}; valid: {TENSOR_CLASSES}")
        if self.kind not in KINDS:
            raise ConfigError(f"tensor {self.name}: unknown kind {self.kind!r}; valid: {KINDS}")
        if self.kind in ("linear", "embedding") and len(self.shape) < 2:
            raise ConfigError(f"tensor {self.name}: a {self.kind} needs at least two dimensions")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


@dataclass(frozen=True)
class ModelShape:
    """What a config.json says about memory: tensors, KV spec, context length."""

    model_type: str
    tensors: tuple[TensorShape, ...]
    kv_spec: KVCacheSpec
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    notes: tuple[str, ...] = ()


ConfigReader = Callable[[Mapping[str, Any], int], ModelShape]
"""``(config dict, block_size) -> ModelShape`` for one family of ``model_type`` names."""


def encoder_estimate(cfg: Mapping[str, Any], cls: str, text_hidden: int) -> list[TensorShape]:
    """A pre-norm transformer encoder (attention with biases, 2-matrix MLP, two LayerNorms per
    layer), a patch/feature embedding and a projector into the text model's hidden size."""
    h = int(cfg.get("hidden_size") or cfg.get("d_model") or 0)
    inter = int(cfg.get("intermediate_size") or cfg.get("encoder_ffn_dim") or 4 * h)
    layers = int(cfg.get("num_hidden_layers") or cfg.get("encoder_layers") or cfg.get("depth") or 0)
    if not h or not layers:
        return []
    p = f"{cls}_tower."
    out: list[TensorShape] = []
    for i in range(layers):
        q = f"{p}layers.{i}."
        out += [TensorShape(q + n + ".weight", cls, (h, h)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        out += [TensorShape(q + "fc1.weight", cls, (inter, h)), TensorShape(q + "fc2.weight", cls, (h, inter))]
        # q/k/v/o and fc1/fc2 biases, two LayerNorms (weight and bias): one vector per layer
        out.append(TensorShape(q + "biases_and_norms", cls, (9 * h + inter,), "vector"))
    patch = int(cfg.get("patch_size") or 0)
    if patch:
        channels = int(cfg.get("num_channels") or 3)
        out.append(TensorShape(p + "patch_embed.weight", cls, (h, channels * patch * patch)))
        image = int(cfg.get("image_size") or 0)
        if image:
            out.append(TensorShape(p + "position_embedding.weight", cls, ((image // patch) ** 2, h), "embedding"))
    if text_hidden:
        out.append(TensorShape(p + "projector.weight", cls, (text_hidden, h)))
    return out
