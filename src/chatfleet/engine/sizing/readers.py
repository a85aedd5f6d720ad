"""The built-in config readers (see ``tensors.py``) but Gemma 4's (``gemma4_reader.py``): dense
decoders of the Llama family (Qwen3, Qwen2, Llama, Mistral), a mixture-of-experts decoder
(Qwen3-MoE) and a sliding/full hybrid (Gemma 3's text model). ``config_readers.py`` lists them
by ``model_type``.

``dense_decoder``: GQA attention (optional q/k norms and biases), SwiGLU MLP, RMSNorms, an
optional tied embedding.

``qwen3_moe``: Qwen3 attention; layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0``
and it is not in ``mlp_only_layers``: a router ``[experts, hidden]`` (kept in 16 bits, as FP8
checkpoints leave it) and per expert gate/up ``[moe_intermediate, hidden]`` and down
``[hidden, moe_intermediate]`` as 3-D ``experts`` tensors; dense layers keep the SwiGLU MLP.

``gemma3_text``: q/k norms, four norms per layer, tied embedding by default, layer types from
``layer_types`` or every ``sliding_window_pattern``-th layer full (the rest sliding with
``sliding_window``): two KV layer groups.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatfleet.engine.kv.spec import KVCacheSpec, spec_from_layer_kinds
from chatfleet.engine.sizing.tensors import ModelShape, TensorShape
from chatfleet.errors import ConfigError


def dense_decoder(cfg: Mapping[str, Any], block_size: int, *, qk_norm: bool, qkv_bias: bool,
                  o_bias: bool) -> ModelShape:
    """Llama-family dense decoder: GQA attention, SwiGLU MLP, RMSNorms, optional tied embedding."""
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        raise ConfigError(f"model type {cfg.get('model_type')!r} with experts needs its own config reader")
    vocab, h, inter, layers, heads = _need(cfg, "vocab_size", "hidden_size", "intermediate_size",
                                           "num_hidden_layers", "num_attention_heads")
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


def read_qwen3(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    bias = bool(cfg.get("attention_bias", False))
    return dense_decoder(cfg, block_size, qk_norm=True, qkv_bias=bias, o_bias=bias)


def read_qwen2(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    return dense_decoder(cfg, block_size, qk_norm=False, qkv_bias=True, o_bias=False)


def read_llama(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    bias = bool(cfg.get("attention_bias", False))
    return dense_decoder(cfg, block_size, qk_norm=False, qkv_bias=bias, o_bias=bias)


def _need(cfg: Mapping[str, Any], *keys: str) -> list[int]:
    try:
        return [int(cfg[k]) for k in keys]
    except KeyError as e:
        raise ConfigError(f"config.json lacks {e.args[0]!r}") from None


def read_qwen3_moe(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    experts, active, moe_inter, layers, h = _need(cfg, "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                  "num_hidden_layers", "hidden_size")
    if active < 1 or active > experts:
        raise ConfigError(f"num_experts_per_tok must be in 1..{experts}, got {active}")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    sparse = [i for i in range(layers) if (i + 1) % step == 0 and i not in dense_only]
    dense_cfg = {k: v for k, v in cfg.items() if k not in ("num_experts", "num_local_experts")}
    dense_cfg.setdefault("intermediate_size", moe_inter)
    bias = bool(cfg.get("attention_bias", False))
    base = dense_decoder(dense_cfg, block_size, qk_norm=True, qkv_bias=bias, o_bias=bias)
    sparse_prefixes = tuple(f"model.layers.{i}.mlp." for i in sparse)
    tensors = [t for t in base.tensors if not t.name.startswith(sparse_prefixes)]
    for i in sparse:
        m = f"model.layers.{i}.mlp."
        tensors += [TensorShape(m + "gate.weight", "experts", (experts, h), "vector"),
                    TensorShape(m + "experts.gate_proj.weight", "experts", (experts, moe_inter, h)),
                    TensorShape(m + "experts.up_proj.weight", "experts", (experts, moe_inter, h)),
                    TensorShape(m + "experts.down_proj.weight", "experts", (experts, h, moe_inter))]
    note = f"{len(sparse)} MoE layers, {active} of {experts} experts active per token"
    return ModelShape("qwen3_moe", tuple(tensors), base.kv_spec, base.max_position_embeddings,
                      base.tie_word_embeddings, base.notes + (note,))


def read_gemma3_text(cfg: Mapping[str, Any], block_size: int) -> ModelShape:
    vocab, h, inter, layers, heads = _need(cfg, "vocab_size", "hidden_size", "intermediate_size",
                                           "num_hidden_layers", "num_attention_heads")
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or 256)
    window = int(cfg.get("sliding_window") or 4096)
    kinds = cfg.get("layer_types")
    if kinds is None:
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        kinds = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if len(kinds) != layers:
        raise ConfigError(f"layer_types lists {len(kinds)} layers, the model has {layers}")
    tied = bool(cfg.get("tie_word_embeddings", True))
    q, kv = heads * head_dim, kv_heads * head_dim
    t = [TensorShape("model.embed_tokens.weight", "embedding", (vocab, h), "embedding")]
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        t += [TensorShape(a + "q_proj.weight", "attention", (q, h)),
              TensorShape(a + "k_proj.weight", "attention", (kv, h)),
              TensorShape(a + "v_proj.weight", "attention", (kv, h)),
              TensorShape(a + "o_proj.weight", "attention", (h, q)),
              TensorShape(a + "q_norm.weight", "norms", (head_dim,), "vector"),
              TensorShape(a + "k_norm.weight", "norms", (head_dim,), "vector"),
              TensorShape(p + "mlp.gate_proj.weight", "mlp", (inter, h)),
              TensorShape(p + "mlp.up_proj.weight", "mlp", (inter, h)),
              TensorShape(p + "mlp.down_proj.weight", "mlp", (h, inter))]
        t += [TensorShape(p + n + ".weight", "norms", (h,), "vector") for n in (
            "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")]
    t.append(TensorShape("model.norm.weight", "norms", (h,), "vector"))
    if not tied:
        t.append(TensorShape("lm_head.weight", "lm_head", (vocab, h), "embedding"))
    spec = spec_from_layer_kinds(kinds, num_kv_heads={"full": kv_heads, "sliding": kv_heads},
                                 head_dim={"full": head_dim, "sliding": head_dim}, sliding_window=window,
                                 block_size=block_size)
    return ModelShape("gemma3_text", tuple(t), spec, int(cfg.get("max_position_embeddings", 131072)), tied,
                      ("lm_head tied to the input embedding: one table",) if tied else ())
