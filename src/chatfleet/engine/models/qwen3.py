"""Qwen3 dense decoder: GQA, per-head q/k RMSNorm, RoPE, SwiGLU, tied or untied embeddings.

``model(input_ids[T], positions[T], attn_metadata, kv_caches) -> hidden[T, H]`` and
``model.compute_logits(hidden[N, H]) -> [N, V]`` (float32). With ``attn_metadata=None`` the
tokens are one sequence under plain causal attention (no cache).
q/k/v and gate/up projections are fused (``qkv_proj``, ``gate_up_proj``); the loader maps the
Hugging Face parameter names onto them. ``use_kernels("onednn")`` prepacks every linear for
oneDNN and routes prefill attention through it (see ``linear.py``); the default is ``torch``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from chatfleet.engine.kv.spec import KVCacheSpec
from chatfleet.engine.models.attention import AttentionMetadata, KVCache, causal_attention, paged_attention
from chatfleet.engine.models.decode_stack import DecodeStack, build_decode_stack
from chatfleet.engine.models.fp8_embedding import FP8Embedding
from chatfleet.engine.models.linear import Linear, onednn_matmul_nt, switch_kernels
from chatfleet.engine.models.prefill_attention import runs_in_onednn
from chatfleet.engine.models.qk_norm_rope import qk_norm_rope
from chatfleet.engine.models.row_buckets import padded_rows, reserve_primitive_cache
from chatfleet.engine.models.row_ops import add_rms_norm, rms_norm
from chatfleet.engine.models.swiglu import GateUpLinear, swiglu
from chatfleet.errors import ConfigError

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class Qwen3Config:
    """The parts of a Hugging Face config.json the model needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> Qwen3Config:
        archs = cfg.get("architectures") or []
        if not any(a in SUPPORTED_ARCHITECTURES for a in archs) and cfg.get("model_type") != "qwen3":
            raise ConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"unsupported hidden_act {cfg['hidden_act']!r}; supported: silu")
        if cfg.get("use_sliding_window"):
            raise ConfigError("sliding-window attention is not supported")
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise ConfigError(f"unsupported rope type {rope_type!r}; supported: default")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
        )

    def kv_cache_spec(self, block_size: int = 16, kv_dtype: str = "float32") -> KVCacheSpec:
        """Every layer is full attention: one layer group."""
        return KVCacheSpec.uniform(self.num_layers, self.num_kv_heads, self.head_dim,
                                   block_size=block_size, kv_dtype=kv_dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Like transformers (float32: one rms_norm; 16 bits: normalized in float32, rounded, then
        # scaled), as one C++ pass where it builds (row_ops.py), else as those torch ops.
        return rms_norm(x, self.weight, self.eps)


class Rotary:
    """cos and sign-folded sin tables for every position, built once (float32 math, like
    transformers): ``sin`` holds -sin on the first half of each row, so that
    ``rotate_half(x) * sin == roll(x, D/2) * folded_sin`` exactly and RoPE is three ops."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        t = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        self.cos = torch.cat((freqs, freqs), dim=-1).cos().to(dtype)
        sin = freqs.sin()
        self.sin = torch.cat((-sin, sin), dim=-1).to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)  # [T, 1, D]


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        self.kernels = "torch"
        self.kv_observer: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # sees k, v (KV scales)
        self.qk_norm_weight: torch.Tensor | None = None  # [Hq + Hkv, D], see fuse_qk_norms

    def fuse_qk_norms(self) -> None:
        """q_norm's weight for every q head, then k_norm's for every kv head, as one table, so
        that one norm and one RoPE run over the q|k heads together (after the weights are
        loaded; ``Qwen3ForCausalLM.init_rotary`` calls it)."""
        q_w, k_w = self.q_norm.weight.detach(), self.k_norm.weight.detach()
        self.qk_norm_weight = torch.cat((q_w.expand(self.num_heads, -1), k_w.expand(self.num_kv_heads, -1)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata | None, cache: KVCache | None, tokens: int | None = None) -> torch.Tensor:
        """x: [rows, hidden], of which the first ``tokens`` (default: all) are the step's tokens and
        the rest padding (``row_buckets``): only the tokens attend and reach the cache."""
        rows = x.shape[0]
        t = rows if tokens is None else tokens
        qkv = self.qkv_proj(x)
        if self.qk_norm_weight is None:
            self.fuse_qk_norms()
        assert self.qk_norm_weight is not None
        qk = qk_norm_rope(qkv, self.num_heads + self.num_kv_heads, self.head_dim, self.qk_norm_weight, cos, sin,
                          self.eps)
        q, k = qk[:t, : self.num_heads], qk[:t, self.num_heads :]
        v = qkv[:t, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.kv_observer is not None:
            self.kv_observer(k, v)
        if meta is None:
            out = causal_attention(q, k, v, self.scale, self.kernels)
        else:
            assert cache is not None
            out = paged_attention(q, k, v, cache, meta, self.scale, self.kernels)
        if rows > t:  # o_proj runs over the padded rows too (zeros there)
            padded = out.new_empty(rows, self.q_size)
            padded[:t] = out.reshape(t, self.q_size)
            padded[t:] = 0
            return self.o_proj(padded)
        return self.o_proj(out.reshape(t, self.q_size))


class Qwen3MLP(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = GateUpLinear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu(gate) * up: in oneDNN's epilogues where packed in bfloat16, else the product then
        # one C++ pass (row_ops.py) or the torch ops (swiglu.py).
        return self.down_proj(swiglu(self.gate_up_proj, x, self.intermediate_size))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata | None, cache: KVCache | None,
                tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to ``residual`` (the first layer: the
        embeddings, and no residual). Returns this layer's MLP output and the residual stream,
        the next layer's (or the final norm's) add still to do: each residual add runs with the
        RMSNorm after it in one pass (``add_rms_norm``), into the sublayer's fresh output tensor."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
            residual = x
        a = self.self_attn(h, cos, sin, meta, cache, tokens)
        h = add_rms_norm(a, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp(h), a


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3Config) -> None:
        super().__init__()
        self.config = cfg
        # A tied model has one table for input and output (lm_head is None): stored once.
        self.embed_tokens: nn.Embedding | FP8Embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: Linear | FP8Embedding | None = (
            None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False))
        self.rotary: Rotary | None = None
        self.kernels = "torch"
        self.decode_stack_enabled = True  # False: decode steps call the layers' modules (tests, A/B runs)
        self._decode_stack: DecodeStack | None = None
        self._decode_stack_built = False

    @property
    def decoder_layers(self) -> Sequence[Qwen3DecoderLayer]:
        """``layers``, typed (to a type checker a ModuleList holds plain Modules)."""
        return cast("Sequence[Qwen3DecoderLayer]", self.layers)

    def use_kernels(self, kernels: str) -> None:
        """Switch to a resolved kernel backend: ``onednn`` packs every linear (once, for good)."""
        if kernels == "onednn" and not runs_in_onednn(self.norm.weight.dtype, self.config.head_dim):
            reserve_primitive_cache()  # every row bucket's linears stay built (row_buckets.py)
        attention = (layer.self_attn for layer in self.decoder_layers)
        self.kernels = switch_kernels(self, attention, self.kernels, kernels)
        self._decode_stack, self._decode_stack_built = None, False

    def decode_stack(self) -> DecodeStack | None:
        """The decoder layers as one C++ call for decode steps (``decode_stack.py``), built at the
        first ask after the oneDNN backend packed the linears; None where it does not apply."""
        if self.kernels != "onednn" or not self.decode_stack_enabled:
            return None
        if not self._decode_stack_built:
            self._decode_stack_built = True
            self._decode_stack = build_decode_stack(self.config, list(self.decoder_layers), self.norm.weight,
                                                    self.norm.weight.dtype)
        return self._decode_stack

    def init_rotary(self) -> None:
        """Build the RoPE tables on the parameters' device and dtype, and each layer's fused q/k
        norm weights (after the weights are placed and loaded)."""
        w = self.norm.weight  # the compute dtype (the embedding table may be FP8)
        self.rotary = Rotary(self.config.head_dim, self.config.rope_theta,
                             self.config.max_position_embeddings, w.dtype, w.device)
        for layer in self.decoder_layers:
            layer.self_attn.fuse_qk_norms()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata | None = None,
                kv_caches: list[KVCache] | None = None) -> torch.Tensor:
        if self.rotary is None:
            self.init_rotary()
        assert self.rotary is not None
        tokens = input_ids.shape[0]
        stack = self.decode_stack() if kv_caches is not None else None
        if stack is not None and stack.takes(tokens, attn_metadata, kv_caches):
            assert isinstance(attn_metadata, AttentionMetadata)
            cos, sin = self.rotary.lookup(positions)
            return stack.run(self.embed_tokens(input_ids), cos, sin, attn_metadata)
        rows = padded_rows(tokens) if self.kernels == "onednn" else tokens
        if rows > tokens:  # row-wise work on a bucketed row count; padding rows are token 0 at position 0
            input_ids, positions = F.pad(input_ids, (0, rows - tokens)), F.pad(positions, (0, rows - tokens))
        cos, sin = self.rotary.lookup(positions)
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for i, layer in enumerate(self.decoder_layers):
            cache = kv_caches[i] if kv_caches is not None else None
            x, residual = layer(x, residual, cos, sin, attn_metadata, cache, tokens)
        if residual is None:  # no layers
            return self.norm(x[:tokens])
        return add_rms_norm(x[:tokens], residual[:tokens], self.norm.weight, self.norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        table = self.lm_head if self.lm_head is not None else self.embed_tokens
        if isinstance(table, FP8Embedding):  # FP8 rows: dequantized a chunk at a time
            return table.logits(hidden)
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.kernels == "onednn":  # tied: the embedding table, unpacked (lookups need it plain)
            return onednn_matmul_nt(hidden.contiguous(), self.embed_tokens.weight).float()
        return F.linear(hidden, self.embed_tokens.weight).float()
