"""A model's tensors by shape and class, from its config.json alone (no torch, no weights).

``model_shape(config, block_size)`` returns a ``ModelShape``: every weight tensor the model
holds (its Hugging Face name, tensor class, shape and kind) and its KV cache spec
(``engine/kv/spec.py``). ``plan/memory.py`` prices it in bytes for a precision.

Extension point: a new architecture is one *config reader*, a function
``(config dict, block_size) -> ModelShape`` registered under its ``model_type`` with
``@config_reader("gemma4")``. The reader lists its tensors with the classes below and builds its
KV spec (``spec_from_layer_kinds`` covers sliding/full layer types, ``kv_tensors=1`` for
layers whose V is their K, ``shared_kv_layers`` for layers that reuse another layer's KV). MoE
experts are one ``linear`` tensor of shape ``[num_experts, out, in]`` in class ``experts``:
leading dimensions count as separate matrices for FP8 scales. Multimodal configs (a
``text_config`` beside ``vision_config`` / ``audio_config``) need no reader of their own: the
text model's reader runs on ``text_config`` and the towers are estimated as ViT-style encoders
(``encoder_estimate``), or a reader registered for the top-level ``model_type`` does it all.
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
CONFIG_READERS: dict[str, ConfigReader] = {}


def config_reader(*model_types: str) -> Callable[[ConfigReader], ConfigReader]:
    """Register a reader for the given ``model_type`` names."""

    def register(fn: ConfigReader) -> ConfigReader:
        for name in model_types:
            CONFIG_READERS[name] = fn
        return fn

    return register


def _reader(model_type: str) -> ConfigReader:
    try:
        return CONFIG_READERS[model_type]
    except KeyError:
        raise ConfigError(f"no memory arithmetic for model type {model_type!r}; known: "
                          f"{', '.join(sorted(CONFIG_READERS))}") from None


def has_config_reader(config: Mapping[str, Any]) -> bool:
    """Whether the memory arithmetic knows this config's model type (or its text model's)."""
    text = config.get("text_config")
    return (config.get("model_type") in CONFIG_READERS
            or (isinstance(text, Mapping) and text.get("model_type") in CONFIG_READERS))


def model_shape(config: Mapping[str, Any], block_size: int = 16) -> ModelShape:
    """The tensors and KV spec of the model a config.json describes (towers included, see module doc)."""
    model_type = config.get("model_type") or ""
    if model_type in CONFIG_READERS:
        return CONFIG_READERS[model_type](config, block_size)
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return _reader(model_type)(config, block_size)  # raises: unknown type
    merged = dict(text)
    for key in ("tie_word_embeddings", "quantization_config"):
        if key in config and key not in merged:
            merged[key] = config[key]
    inner = _reader(merged.get("model_type") or "")(merged, block_size)
    towers = [t for cls in TOWER_CLASSES if isinstance(config.get(f"{cls}_config"), Mapping)
              for t in encoder_estimate(config[f"{cls}_config"], cls, merged.get("hidden_size", 0))]
    notes = inner.notes + tuple(f"{cls} tower estimated as a ViT-style encoder" for cls in TOWER_CLASSES
                                if isinstance(config.get(f"{cls}_config"), Mapping))
    return ModelShape(model_type, inner.tensors + tuple(towers), inner.kv_spec, inner.max_position_embeddings,
                      inner.tie_word_embeddings, notes)


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


# ---- readers --------------------------------------------------------------------------------------
def _dense_decoder(cfg: Mapping[str, Any], block_size: int, *, qk_norm: bool, qkv_bias: bool,
                   o_bias: bool) -> ModelShape:
    """Llama-family dense decoder: GQA attention, SwiGLU MLP, RMSNorms, optional tied embedding."""
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise ConfigError(f"model type {cfg.get('model_type')!r} with experts needs its own config reader")
    try:
        vocab, h, inter = int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        layers, heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}") from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    tied = bool(cfg.get("tie_word_embeddings", False))
    t: list[TensorShape] = [TensorShape("model.embed_tokens.weight", "embedding", (vocab, h), "embedding")]
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t += [TensorShape(a + "q_proj.weight", "attention", (q, h)),
              TensorShape(a + "k_proj.weight", "attention", (kv, h)),
              TensorShape(a + "v_proj.weight", "attention", (kv, h)),
              TensorShape(a + "o_proj.weight", "attention", (h, q))]
        if qkv_bias:
            t += [TensorShape(a + f"{n}_proj.bias", "attention", (s,), "vector")
                  for n, s in (("q", q), ("k", kv), ("v", kv))]
        if o_bias:
            t.append(TensorShape(a + "o_proj.bias", "attention", (h,), "vector"))
        if qk_norm:
            t += [TensorShape(a + "q_norm.weight", "norms", (head_dim,), "vector"),
                  TensorShape(a + "k_norm.weight", "norms", (head_dim,), "vector")]
        m = p + "mlp."
        t += [TensorShape(m + "gate_proj.weight", "mlp", (inter, h)),
              TensorShape(m + "up_proj.weight", "mlp", (inter, h)),
              TensorShape(m + "down_proj.weight", "mlp", (h, inter)),
              TensorShape(p + "input_layernorm.weight", "norms", (h,), "vector"),
              TensorShape(p + "post_attention_layernorm.weight", "norms", (h,), "vector")]
    t.append(TensorShape("model.norm.weight", "norms", (h,), "vector"))
    if not tied:
        t.append(TensorShape("lm_head.weight", "lm_head", (vocab, h), "embedding"))
    spec = KVCacheSpec.uniform(layers, kv_heads, head_dim, block_size=block_size)
    return ModelShape(str(cfg.get("model_type")), tuple(t), spec, int(cfg.get("max_position_embeddings", 32768)),
                      tied, ("lm_head tied to the input embedding: one table",) if tied else ())


@config_reader("qwen3")
def read_qwen3(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    bias = bool(cfg.get("attention_bias", False))
    return _dense_decoder(cfg, block_size, qk_norm=True, qkv_bias=bias, o_bias=bias)


@config_reader("qwen2")
def read_qwen2(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    return _dense_decoder(cfg, block_size, qk_norm=False, qkv_bias=True, o_bias=False)


@config_reader("llama", "mistral")
def read_llama(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    bias = bool(cfg.get("attention_bias", False))
    return _dense_decoder(cfg, block_size, qk_norm=False, qkv_bias=bias, o_bias=bias)


# Readers that live in their own modules register on import.
from chatfleet.plan import gemma4_reader  # noqa: E402,F401
from chatfleet.plan import readers  # noqa: E402,F401  (qwen3_moe, gemma3_text)
