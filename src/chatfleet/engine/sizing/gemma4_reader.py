"""Gemma 4's tensors from its config.json (the config reader of ``gemma4_text`` and ``gemma4``).

The text model is listed tensor by tensor as the checkpoint holds it (``engine/models/
gemma4_config.py`` reads the config, so the planner and the engine agree on every field): per
layer type its own head dim and KV heads, no ``v_proj`` on full layers with
``attention_k_eq_v``, no k/v on KV-sharing layers, the MoE block (router, 3-D expert tensors in
class ``experts``) and per-layer inputs. A ``Gemma4ForConditionalGeneration`` config adds its
vision tower exactly as ``transformers`` lays it out (class ``vision``) and an audio tower as a
ViT-style estimate (class ``audio``); both are skipped when serving the language model only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatfleet.engine.models.gemma4_config import FULL, SLIDING, Gemma4Config
from chatfleet.engine.sizing.tensors import ModelShape, TensorShape, encoder_estimate


def _text_tensors(cfg: Gemma4Config, prefix: str) -> list[TensorShape]:
    h, heads = cfg.hidden_size, cfg.num_heads
    t = [TensorShape(prefix + "embed_tokens.weight", "embedding", (cfg.vocab_size, h), "embedding")]
    p_dim = cfg.hidden_size_per_layer_input
    if p_dim:
        t += [TensorShape(prefix + "embed_tokens_per_layer.weight", "embedding",
                          (cfg.vocab_size_per_layer_input, cfg.num_layers * p_dim), "embedding"),
              TensorShape(prefix + "per_layer_model_projection.weight", "mlp", (cfg.num_layers * p_dim, h)),
              TensorShape(prefix + "per_layer_projection_norm.weight", "norms", (p_dim,), "vector")]
    for i, kind in enumerate(cfg.layer_types):
        a = cfg.attention(kind)
        p = f"{prefix}layers.{i}."
        q, kv = heads * a.head_dim, a.num_kv_heads * a.head_dim
        t += [TensorShape(p + "self_attn.q_proj.weight", "attention", (q, h)),
              TensorShape(p + "self_attn.o_proj.weight", "attention", (h, q)),
              TensorShape(p + "self_attn.q_norm.weight", "norms", (a.head_dim,), "vector")]
        if not cfg.is_kv_shared(i):
            t += [TensorShape(p + "self_attn.k_proj.weight", "attention", (kv, h)),
                  TensorShape(p + "self_attn.k_norm.weight", "norms", (a.head_dim,), "vector")]
            if not (cfg.attention_k_eq_v and kind == FULL):
                t.append(TensorShape(p + "self_attn.v_proj.weight", "attention", (kv, h)))
        if cfg.attention_bias:
            t += [TensorShape(p + f"self_attn.{n}_proj.bias", "attention", (s,), "vector")
                  for n, s in (("q", q), ("o", h)) + ((("k", kv),) if not cfg.is_kv_shared(i) else ())
                  + ((("v", kv),) if not cfg.is_kv_shared(i) and not (cfg.attention_k_eq_v and kind == FULL) else ())]
        inter = cfg.mlp_intermediate_size(i)
        t += [TensorShape(p + "mlp.gate_proj.weight", "mlp", (inter, h)),
              TensorShape(p + "mlp.up_proj.weight", "mlp", (inter, h)),
              TensorShape(p + "mlp.down_proj.weight", "mlp", (h, inter)),
              TensorShape(p + "layer_scalar", "norms", (1,), "vector")]
        norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"]
        if cfg.enable_moe_block:
            e, m = cfg.num_experts, cfg.moe_intermediate_size
            t += [TensorShape(p + "router.proj.weight", "experts", (e, h)),
                  TensorShape(p + "router.scale", "norms", (h,), "vector"),
                  TensorShape(p + "router.per_expert_scale", "norms", (e,), "vector"),
                  TensorShape(p + "experts.gate_up_proj", "experts", (e, 2 * m, h)),
                  TensorShape(p + "experts.down_proj", "experts", (e, h, m))]
            norms += ["post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"]
        if p_dim:
            t += [TensorShape(p + "per_layer_input_gate.weight", "mlp", (p_dim, h)),
                  TensorShape(p + "per_layer_projection.weight", "mlp", (h, p_dim))]
            norms.append("post_per_layer_input_norm")
        t += [TensorShape(p + n + ".weight", "norms", (h,), "vector") for n in norms]
    t.append(TensorShape(prefix + "norm.weight", "norms", (h,), "vector"))
    if not cfg.tie_word_embeddings:
        t.append(TensorShape("lm_head.weight", "lm_head", (cfg.vocab_size, h), "embedding"))
    return t


def _vision_tensors(v: Mapping[str, Any], text_hidden: int) -> list[TensorShape]:
    """``Gemma4VisionModel`` and its embedder, as transformers 5.x holds them."""
    h = int(v.get("hidden_size", 768))
    inter = int(v.get("intermediate_size", 3072))
    heads, kv_heads = int(v.get("num_attention_heads", 12)), int(v.get("num_key_value_heads", 12))
    d = int(v.get("head_dim", 64))
    patch = int(v.get("patch_size", 16))
    p = "model.vision_tower."
    t = [TensorShape(p + "patch_embedder.position_embedding_table", "vision",
                     (2, int(v.get("position_embedding_size", 10240)), h), "embedding"),
         TensorShape(p + "patch_embedder.input_proj.weight", "vision", (h, 3 * patch * patch))]
    clipped = bool(v.get("use_clipped_linears", False))
    for i in range(int(v.get("num_hidden_layers", 16))):
        q = f"{p}encoder.layers.{i}."
        linears = [("self_attn.q_proj", heads * d, h), ("self_attn.k_proj", kv_heads * d, h),
                   ("self_attn.v_proj", kv_heads * d, h), ("self_attn.o_proj", h, heads * d),
                   ("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h), ("mlp.down_proj", h, inter)]
        for name, out, inp in linears:
            t.append(TensorShape(q + name + ".linear.weight", "vision", (out, inp)))
            if clipped:
                t += [TensorShape(q + name + f".{b}", "vision", (), "vector")
                      for b in ("input_min", "input_max", "output_min", "output_max")]
        t += [TensorShape(q + "self_attn.q_norm.weight", "vision", (d,), "vector"),
              TensorShape(q + "self_attn.k_norm.weight", "vision", (d,), "vector")]
        t += [TensorShape(q + n + ".weight", "vision", (h,), "vector")
              for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                        "post_feedforward_layernorm")]
    if v.get("standardize"):
        t += [TensorShape(p + "std_bias", "vision", (h,), "vector"),
              TensorShape(p + "std_scale", "vision", (h,), "vector")]
    t.append(TensorShape("model.embed_vision.embedding_projection.weight", "vision", (text_hidden, h)))
    return t


def read_gemma4(config: Mapping[str, Any], block_size: int) -> ModelShape:
    cfg = Gemma4Config.from_hf(config)
    tensors = _text_tensors(cfg, cfg.weight_prefix)
    notes = []
    if cfg.multimodal:
        if isinstance(config.get("vision_config"), Mapping):
            tensors += _vision_tensors(config["vision_config"], cfg.hidden_size)
        if isinstance(config.get("audio_config"), Mapping):
            tensors += encoder_estimate(config["audio_config"], "audio", cfg.hidden_size)
            notes.append("audio tower estimated as a ViT-style encoder")
    if cfg.tie_word_embeddings:
        notes.append("lm_head tied to the input embedding: one table")
    kinds = ", ".join(f"{cfg.layer_types.count(k)} {k.split('_')[0]}" for k in (SLIDING, FULL) if k in cfg.layer_types)
    notes.append(f"layers: {kinds}" + (f", window {cfg.sliding_window}" if cfg.sliding_window else ""))
    return ModelShape(str(config.get("model_type")), tuple(tensors), cfg.kv_cache_spec(block_size),
                      cfg.max_position_embeddings, cfg.tie_word_embeddings, tuple(notes))
