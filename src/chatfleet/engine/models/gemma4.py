"""Gemma 4 text decoder, dense and mixture-of-experts (the 26B-A4B layout), on the paged cache.

``model(input_ids[T], positions[T], attn_metadata, kv_caches) -> hidden[T, H]`` and
``model.compute_logits(hidden[N, H]) -> [N, V]`` (float32), like ``qwen3.py``.
``attn_metadata`` is one ``AttentionMetadata`` per KV group name (``{"full": ..., "sliding":
...}``, see ``gemma4_config.GROUP_OF_KIND``): sliding layers attend with their window and may
read their own block tables. ``kv_caches[i]`` is layer i's cache (None for a KV-sharing layer,
which reads the cache of ``config.kv_source(i)``). With ``attn_metadata=None`` the tokens are one
sequence under plain causal (and windowed) attention.

What a layer does, as ``transformers``' ``Gemma4TextDecoderLayer``:
- attention: q/k RMS-normed per head (with scale), v RMS-normed without scale, no 1/sqrt(d)
  score scaling; RoPE per layer type (sliding: default, full: proportional, rotating only part
  of the frequencies); full layers may use their own head dim and KV heads, and with
  ``attention_k_eq_v`` take V from the K projection; the last ``num_kv_shared_layers`` layers
  reuse the KV of the last earlier layer of their type;
- sandwich norms around attention and feed-forward; with the MoE block a dense MLP and the
  routed experts (``moe.py``) run side by side on the same residual and are summed;
- optional per-layer input embeddings (``hidden_size_per_layer_input``), then ``layer_scalar``.
Embeddings are scaled by sqrt(hidden) (in the weight dtype); logits are soft-capped when set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from chatfleet.engine.models.attention import (
    AttentionMetadata,
    KVCache,
    causal_attention,
    paged_attention,
)
from chatfleet.engine.models.gemma4_config import GROUP_OF_KIND, SLIDING, Gemma4Config
from chatfleet.engine.models.linear import Linear, onednn_matmul_nt, switch_kernels
from chatfleet.engine.models.moe import Experts, GatedMLP, Router

SharedKV = dict[str, tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """Gemma 4's RMS norm: float32 math, times ``weight`` (or nothing), cast back."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps, self.dim = eps, dim
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.dim,), w, self.eps)
        return F.rms_norm(x.float(), (self.dim,), None if w is None else w.float(), self.eps).to(x.dtype)


def rotary(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, head_dim] for the positions (float32 math, like transformers)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int) -> None:
        super().__init__()
        self.kind = cfg.layer_types[layer]
        kind = cfg.attention(self.kind)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, kind.num_kv_heads, kind.head_dim
        self.window = kind.sliding_window
        self.shared = cfg.is_kv_shared(layer)
        self.stores_shared = not self.shared and cfg.num_kv_shared_layers > 0 and any(
            cfg.kv_source(j) == layer for j in range(cfg.first_kv_shared_layer, cfg.num_layers))
        self.k_eq_v = cfg.attention_k_eq_v and self.kind != SLIDING
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = cfg.attention_bias
        if self.shared:
            self.q_proj = Linear(cfg.hidden_size, self.q_size, bias=bias)
        else:
            parts = 2 if self.k_eq_v else 3
            self.qkv_proj = Linear(cfg.hidden_size, self.q_size + (parts - 1) * self.kv_size, bias=bias)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.v_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, with_scale=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=bias)
        self.kernels = "torch"

    def qkv_part_sizes(self) -> list[int]:
        """Rows of q, k (and v) inside ``qkv_proj`` (for the loader)."""
        return [self.q_size, self.kv_size] + ([] if self.k_eq_v else [self.kv_size])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata | None,
                cache: KVCache | None, shared_kv: SharedKV) -> torch.Tensor:
        t = x.shape[0]
        if self.shared:
            q = self.q_proj(x)
            k, v = shared_kv[self.kind]
        else:
            qkv = self.qkv_proj(x).split(self.qkv_part_sizes(), dim=-1)
            q, k_raw = qkv[0], qkv[1].view(t, self.num_kv_heads, self.head_dim)
            v_raw = k_raw if self.k_eq_v else qkv[2].view(t, self.num_kv_heads, self.head_dim)
            k = apply_rope(self.k_norm(k_raw), cos, sin)
            v = self.v_norm(v_raw)
            if self.stores_shared:
                shared_kv[self.kind] = (k, v)
        q = apply_rope(self.q_norm(q.view(t, self.num_heads, self.head_dim)), cos, sin)
        if meta is None:
            out = causal_attention(q, k, v, 1.0, self.kernels, self.window)
        else:
            assert cache is not None
            out = paged_attention(q, k, v, cache, meta, 1.0, self.kernels, write=not self.shared)
        return self.o_proj(out.reshape(t, self.q_size))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, layer: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Gemma4Attention(cfg, layer)
        self.mlp = GatedMLP(h, cfg.mlp_intermediate_size(layer))
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(h, cfg.num_experts, cfg.top_k_experts, eps)
            self.experts = Experts(h, cfg.moe_intermediate_size, cfg.num_experts)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.ple = cfg.hidden_size_per_layer_input > 0
        if self.ple:
            self.per_layer_input_gate = Linear(h, cfg.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = Linear(cfg.hidden_size_per_layer_input, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, meta: AttentionMetadata | None, cache: KVCache | None,
                shared_kv: SharedKV) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta, cache, shared_kv)
        x = x + self.post_attention_layernorm(attn)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe:
            routed = self.experts(self.pre_feedforward_layernorm_2(x), self.router(x))
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if self.ple:
            assert per_layer_input is not None
            g = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(g))
        return x * self.layer_scalar


class Gemma4ForCausalLM(nn.Module):
    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(h, cfg.vocab_size, bias=False)
        p = cfg.hidden_size_per_layer_input
        if p:
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, cfg.num_layers * p)
            self.per_layer_model_projection = Linear(h, cfg.num_layers * p, bias=False)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)
        self.kernels = "torch"
        self._inv_freq: dict[str, torch.Tensor] = {}
        self._groups = [GROUP_OF_KIND[t] for t in cfg.layer_types]
        self._kv_source = [cfg.kv_source(i) for i in range(cfg.num_layers)]

    @property
    def decoder_layers(self) -> Sequence[Gemma4DecoderLayer]:
        """``layers``, typed (to a type checker a ModuleList holds plain Modules)."""
        return cast("Sequence[Gemma4DecoderLayer]", self.layers)

    def use_kernels(self, kernels: str) -> None:
        """Switch to a resolved kernel backend: ``onednn`` packs every linear (once, for good)."""
        attention = (layer.self_attn for layer in self.decoder_layers)
        self.kernels = switch_kernels(self, attention, self.kernels, kernels)

    def init_rotary(self) -> None:
        """RoPE inverse frequencies per layer type, on the parameters' device."""
        device = self.embed_tokens.weight.device
        self._inv_freq = {kind: a.rope.inv_freq(a.head_dim).to(device) for kind, a in self.config.kinds}

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[T, L, P]: (projection of the embeddings + per-layer token embeddings) / sqrt(2)."""
        cfg, p = self.config, self.config.hidden_size_per_layer_input
        w = self.embed_tokens_per_layer.weight
        tok = self.embed_tokens_per_layer(input_ids) * torch.tensor(p**0.5, dtype=w.dtype)
        proj = self.per_layer_model_projection(x) * cfg.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(-1, cfg.num_layers, p))
        return (proj + tok.view(-1, cfg.num_layers, p)) * 2.0**-0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata | Mapping[str, AttentionMetadata] | None = None,
                kv_caches: list[KVCache | None] | None = None) -> torch.Tensor:
        if not self._inv_freq:
            self.init_rotary()
        w = self.embed_tokens.weight
        x = self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size**0.5, dtype=w.dtype)
        ple = self._per_layer_inputs(input_ids, x) if self.config.hidden_size_per_layer_input else None
        rope = {kind: rotary(f, positions, x.dtype) for kind, f in self._inv_freq.items()}
        shared_kv: SharedKV = {}
        for i, layer in enumerate(self.layers):
            kind = self.config.layer_types[i]
            meta = attn_metadata
            if isinstance(attn_metadata, Mapping):
                meta = attn_metadata[self._groups[i]]
            cache = kv_caches[self._kv_source[i]] if kv_caches is not None else None
            cos, sin = rope[kind]
            x = layer(x, None if ple is None else ple[:, i], cos, sin, meta, cache, shared_kv)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif self.kernels == "onednn":  # tied: the embedding table, unpacked (lookups need it plain)
            logits = onednn_matmul_nt(hidden.contiguous(), self.embed_tokens.weight).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
