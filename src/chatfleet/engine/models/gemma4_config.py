"""Gemma 4 text configuration, read from a config.json as ``transformers`` 5.x writes it.

Both layouts are read: ``Gemma4ForCausalLM`` (the text config at the top level) and
``Gemma4ForConditionalGeneration`` (the text config under ``text_config``, the language model's
weights under ``model.language_model.``, vision/audio towers beside it).

No torch at import: ``engine/sizing/gemma4_reader.py`` prices a Gemma 4 from this reading alone.

Per layer type (``layer_types``: ``sliding_attention`` / ``full_attention``) the attention has
its own head dim, KV heads, RoPE and span. Full layers take ``global_head_dim`` (and
``num_global_key_value_heads`` when ``attention_k_eq_v``) as ``transformers`` does, or the
``per_layer_config`` overrides it saves. Anything the engine does not implement fails here with
a ConfigError naming the field, never as a silently wrong model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from chatfleet.engine.kv.spec import KVCacheSpec, spec_from_layer_kinds
from chatfleet.errors import ConfigError

if TYPE_CHECKING:  # torch only where the model is built: the planner reads configs without it
    import torch

ARCHITECTURES = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
MODEL_TYPES = ("gemma4", "gemma4_text")
SLIDING, FULL = "sliding_attention", "full_attention"
GROUP_OF_KIND = {FULL: "full", SLIDING: "sliding"}  # layer type -> KV spec group name
ACTIVATIONS = ("gelu_pytorch_tanh",)
_PER_LAYER_FIELDS = ("head_dim", "num_key_value_heads")
_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


def is_gemma4(cfg: Mapping[str, Any]) -> bool:
    archs = cfg.get("architectures") or []
    return any(a in ARCHITECTURES for a in archs) or cfg.get("model_type") in MODEL_TYPES


@dataclass(frozen=True)
class RopeSpec:
    """``default`` RoPE, or ``proportional``: only the first ``partial_rotary_factor`` of the
    frequencies rotate (the rest are 0), all over ``head_dim``, divided by ``factor``."""

    theta: float
    rope_type: str = "default"
    partial_rotary_factor: float = 1.0
    factor: float = 1.0

    @classmethod
    def from_hf(cls, kind: str, params: Mapping[str, Any]) -> RopeSpec:
        rope_type = params.get("rope_type", "default")
        if rope_type not in ("default", "proportional"):
            raise ConfigError(f"rope_parameters[{kind!r}].rope_type {rope_type!r} is not supported;"
                              " supported: default, proportional")
        extra = set(params) - {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
        if extra:
            raise ConfigError(f"rope_parameters[{kind!r}] fields {sorted(extra)} are not supported")
        if rope_type == "default" and (params.get("partial_rotary_factor", 1.0) != 1.0
                                       or params.get("factor", 1.0) != 1.0):
            raise ConfigError(f"rope_parameters[{kind!r}]: partial_rotary_factor/factor need rope_type"
                              " 'proportional'")
        return cls(float(params["rope_theta"]), rope_type, float(params.get("partial_rotary_factor", 1.0)),
                   float(params.get("factor", 1.0)))

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """[head_dim // 2] float32, as ``transformers`` computes it."""
        import torch

        if self.rope_type == "default":
            return 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        angles = int(self.partial_rotary_factor * head_dim // 2)
        rotated = 1.0 / (self.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim))
        inv = torch.cat((rotated, torch.zeros(head_dim // 2 - angles)))
        return inv / self.factor


@dataclass(frozen=True)
class AttentionKind:
    """What the layers of one type share: head dim, KV heads, RoPE, span."""

    head_dim: int
    num_kv_heads: int
    rope: RopeSpec
    sliding_window: int | None


@dataclass(frozen=True)
class Gemma4Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: tuple[str, ...]
    kinds: tuple[tuple[str, AttentionKind], ...]  # (layer type, its attention), for each type used
    sliding_window: int | None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131_072
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    num_experts: int = 0  # 0: no MoE block
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0  # per-layer input embeddings (0: none)
    vocab_size_per_layer_input: int = 0
    multimodal: bool = False  # a Gemma4ForConditionalGeneration folder

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def weight_prefix(self) -> str:
        """Where the text model's tensors live in the checkpoint."""
        return "model.language_model." if self.multimodal else "model."

    @property
    def enable_moe_block(self) -> bool:
        return self.num_experts > 0

    @property
    def first_kv_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def attention(self, layer_type: str) -> AttentionKind:
        return dict(self.kinds)[layer_type]

    def is_kv_shared(self, layer: int) -> bool:
        return layer >= self.first_kv_shared_layer

    def kv_source(self, layer: int) -> int:
        """The layer whose KV cache ``layer`` reads: itself, or for a KV-sharing layer the last
        non-sharing layer of the same type (as ``transformers``' ``kv_sharing_modes``)."""
        if not self.is_kv_shared(layer):
            return layer
        kind = self.layer_types[layer]
        return max(i for i in range(self.first_kv_shared_layer) if self.layer_types[i] == kind)

    def mlp_intermediate_size(self, layer: int) -> int:
        wide = self.use_double_wide_mlp and self.is_kv_shared(layer)
        return self.intermediate_size * (2 if wide else 1)

    def kv_cache_spec(self, block_size: int = 16, kv_dtype: str = "float32") -> KVCacheSpec:
        """A ``full`` and a ``sliding`` group (those used); KV-sharing layers store nothing.

        K and V are stored separately even where ``attention_k_eq_v`` makes them come from one
        projection: V is RMS-normed without scale and not rotated, so the stored tensors differ.
        """
        kinds = dict(self.kinds)
        return spec_from_layer_kinds(
            self.layer_types,
            num_kv_heads={GROUP_OF_KIND[k]: a.num_kv_heads for k, a in kinds.items()},
            head_dim={GROUP_OF_KIND[k]: a.head_dim for k, a in kinds.items()},
            sliding_window=self.sliding_window,
            block_size=block_size,
            kv_dtype=kv_dtype,
            shared_kv_layers=tuple(range(self.first_kv_shared_layer, self.num_layers)),
        )

    # ---- reading config.json ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Gemma4Config:
        if not is_gemma4(cfg):
            raise ConfigError(f"not a Gemma 4 config: {cfg.get('architectures') or cfg.get('model_type')!r}")
        multimodal = "text_config" in cfg or cfg.get("model_type") == "gemma4"
        text: Mapping[str, Any] = cfg.get("text_config") or {} if multimodal else cfg
        if multimodal and not text:
            raise ConfigError("a Gemma4ForConditionalGeneration config needs text_config")
        return _read_text_config(text, multimodal)


def _get(text: Mapping[str, Any], key: str, default: Any) -> Any:
    value = text.get(key, default)
    return default if value is None else value


def _read_text_config(text: Mapping[str, Any], multimodal: bool) -> Gemma4Config:
    for key, bad in (("use_bidirectional_attention", "all"),):
        if text.get(key) == bad:
            raise ConfigError(f"{key}={bad!r} is not supported (text serving is causal)")
    for key in ("attn_logit_softcapping", "query_pre_attn_scalar"):
        if text.get(key) is not None:
            raise ConfigError(f"Gemma 4 config field {key!r} is not supported")
    act = _get(text, "hidden_activation", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ConfigError(f"hidden_activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    num_layers = int(text.get("num_hidden_layers", 30))
    layer_types = list(text.get("layer_types") or
                       [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)])
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types lists {len(layer_types)} layers, num_hidden_layers is {num_layers}")
    unknown = set(layer_types) - {SLIDING, FULL}
    if unknown:
        raise ConfigError(f"layer_types {sorted(unknown)} are not supported; supported: {SLIDING}, {FULL}")
    layer_types[-1] = FULL  # transformers forces the last layer to full attention
    heads = int(_get(text, "num_attention_heads", 8))
    head_dim = int(_get(text, "head_dim", 256))
    kv_heads = int(_get(text, "num_key_value_heads", 4))
    k_eq_v = bool(text.get("attention_k_eq_v", False))
    sliding_window = int(_get(text, "sliding_window", 512))
    per_layer = _per_layer_overrides(text, layer_types, k_eq_v)
    rope_params = text.get("rope_parameters") or _DEFAULT_ROPE
    kinds = []
    for kind in (FULL, SLIDING):
        if kind not in layer_types:
            continue
        over = per_layer.get(kind, {})
        if kind not in rope_params:
            raise ConfigError(f"rope_parameters has no entry for {kind!r}")
        dim = int(over.get("head_dim", head_dim))
        if dim % 2:
            raise ConfigError(f"{kind} head_dim must be even for RoPE, got {dim}")
        nkv = int(over.get("num_key_value_heads", kv_heads))
        if heads % nkv:
            raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of the {kind} KV heads ({nkv})")
        kinds.append((kind, AttentionKind(dim, nkv, RopeSpec.from_hf(kind, rope_params[kind]),
                                          sliding_window if kind == SLIDING else None)))
    shared = int(_get(text, "num_kv_shared_layers", 0))
    if not 0 <= shared < num_layers:
        raise ConfigError(f"num_kv_shared_layers must be in 0..{num_layers - 1}, got {shared}")
    if shared and set(layer_types[: num_layers - shared]) != set(layer_types):
        raise ConfigError("num_kv_shared_layers: every layer type that reuses KV needs an earlier layer"
                          " of its type that stores it")
    moe = bool(text.get("enable_moe_block", False))
    num_experts = int(_get(text, "num_experts", 0)) if moe else 0
    top_k = int(_get(text, "top_k_experts", 0)) if moe else 0
    moe_inter = int(_get(text, "moe_intermediate_size", 0)) if moe else 0
    if moe and not (num_experts >= 1 and 1 <= top_k <= num_experts and moe_inter >= 1):
        raise ConfigError("enable_moe_block needs num_experts >= 1, 1 <= top_k_experts <= num_experts and"
                          f" moe_intermediate_size >= 1; got {num_experts}, {top_k}, {moe_inter}")
    cap = text.get("final_logit_softcapping")
    ple = int(_get(text, "hidden_size_per_layer_input", 256))
    vocab = int(text["vocab_size"])
    return Gemma4Config(
        vocab_size=vocab,
        hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]),
        num_heads=heads,
        layer_types=tuple(layer_types),
        kinds=tuple(kinds),
        sliding_window=sliding_window if SLIDING in layer_types else None,
        rms_norm_eps=float(_get(text, "rms_norm_eps", 1e-6)),
        max_position_embeddings=int(_get(text, "max_position_embeddings", 131_072)),
        tie_word_embeddings=bool(_get(text, "tie_word_embeddings", True)),
        attention_bias=bool(text.get("attention_bias", False)),
        attention_k_eq_v=k_eq_v,
        num_kv_shared_layers=shared,
        use_double_wide_mlp=bool(text.get("use_double_wide_mlp", False)),
        num_experts=num_experts,
        top_k_experts=top_k,
        moe_intermediate_size=moe_inter,
        final_logit_softcapping=float(cap) if cap is not None else None,
        hidden_size_per_layer_input=ple,
        vocab_size_per_layer_input=int(_get(text, "vocab_size_per_layer_input", vocab)) if ple else 0,
        multimodal=multimodal,
    )


def _per_layer_overrides(text: Mapping[str, Any], layer_types: list[str], k_eq_v: bool) -> dict[str, dict]:
    """Head dim / KV heads per layer type, from ``per_layer_config`` or the global_* fields."""
    if text.get("per_layer_config") is None:
        over: dict[str, Any] = {"head_dim": text.get("global_head_dim") or 512}
        if k_eq_v and text.get("num_global_key_value_heads") is not None:
            over["num_key_value_heads"] = text["num_global_key_value_heads"]
        return {FULL: over}
    by_kind: dict[str, dict] = {}
    seen: dict[str, set[int]] = {}
    for key, values in dict(text["per_layer_config"]).items():
        layer = int(key)
        if not 0 <= layer < len(layer_types):
            raise ConfigError(f"per_layer_config names layer {layer}, the model has {len(layer_types)}")
        values = dict(values or {})
        extra = set(values) - set(_PER_LAYER_FIELDS)
        if extra:
            raise ConfigError(f"per_layer_config[{layer}] fields {sorted(extra)} are not supported;"
                              f" supported: {', '.join(_PER_LAYER_FIELDS)}")
        kind = layer_types[layer]
        if kind in by_kind and by_kind[kind] != values:
            raise ConfigError(f"per_layer_config: {kind} layers with different overrides are not supported")
        by_kind[kind] = values
        seen.setdefault(kind, set()).add(layer)
    for kind, layers in seen.items():
        if layers != {i for i, t in enumerate(layer_types) if t == kind}:
            raise ConfigError(f"per_layer_config overrides only some {kind} layers; not supported")
    return by_kind
