"""The one memory arithmetic: weights by class, KV bytes per token, and the pool a budget leaves.

``memory_breakdown(config, ...)`` prices a model from its config.json dict alone (no torch, no
weights): the engine logs and exports it at start-up, the planner predicts GPUs with it, and a
test holds it equal to the loaded model's actual tensor bytes.

Precision:
- ``dtype``: the 16/32-bit dtype of every unquantized tensor (the engine's ``--dtype``);
- ``quantization``: None keeps what the checkpoint declares (FP8 when its
  ``quantization_config`` says so, see ``engine/models/fp8_format.py``); ``"fp8"`` quantizes the
  linears block-wise ``[128, 128]`` at load (or keeps the checkpoint's FP8 format). FP8 linears
  cost one byte per weight plus float32 scales (class ``scales``): block-wise
  ``ceil(out/128) * ceil(in/128)`` per matrix, per-tensor one, per-channel ``out``;
- ``embedding_dtype``: ``"auto"`` (= ``dtype``) or ``"fp8"``: the embedding table and lm_head
  in FP8 with one float32 scale per row. A tied lm_head is the embedding table: counted once;
- ``kv_cache_dtype``: ``"auto"`` (= ``dtype``), ``float32``, ``bfloat16``, ``float16`` or ``fp8``.

Pool: give at most one of ``budget_bytes`` (weights + KV + ``reserved_bytes`` must fit:
``budget - weights - reserved -> KV pool``), ``kv_cache_bytes`` or ``kv_cache_tokens``.
``language_model_only`` marks vision/audio towers as skipped (listed, not counted).
New architectures: add a config reader to ``config_readers.py`` (see ``tensors.py``'s docstring).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from chatfleet.engine.kv.spec import KVCacheSpec, PoolPlan
from chatfleet.engine.models.fp8_format import SCALE_BYTES, FP8WeightFormat, weights_format_for
from chatfleet.engine.sizing.config_readers import model_shape
from chatfleet.engine.sizing.tensors import TENSOR_CLASSES, TOWER_CLASSES, TensorShape
from chatfleet.errors import ConfigError

DTYPE_BYTES: Mapping[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1}
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
            "fp8_e4m3": "fp8", "float8_e4m3fn": "fp8"}
BREAKDOWN_CLASSES = TENSOR_CLASSES + ("scales",)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")
EMBEDDING_DTYPES = ("auto", "fp8")


def normalize_dtype(name: str, allowed: tuple[str, ...] = ("float32", "bfloat16", "float16")) -> str:
    n = _ALIASES.get(name, name)
    if n not in allowed:
        raise ConfigError(f"unknown dtype {name!r}; valid: {', '.join(allowed)}")
    return n


@dataclass(frozen=True)
class ClassBytes:
    """One tensor class's weights: parameter count, bytes, and what they are stored as."""

    tensor_class: str
    num_params: int
    num_bytes: int
    dtype: str
    skipped: bool = False  # a vision/audio tower left out (language_model_only)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where the memory of one replica goes. Every byte count is exact for the engine's layout."""

    model_type: str
    dtype: str
    weights_format: str  # e.g. "bfloat16" or "fp8 e4m3, block-wise [128,128] scales"
    embedding_dtype: str
    classes: tuple[ClassBytes, ...]  # in BREAKDOWN_CLASSES order, only classes the model has
    kv_spec: KVCacheSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    pool: PoolPlan | None = None
    budget_bytes: int | None = None
    reserved_bytes: int = 0
    notes: tuple[str, ...] = ()

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight and scale the replica holds (skipped towers excluded)."""
        return sum(c.num_bytes for c in self.classes if not c.skipped)

    @property
    def skipped_bytes(self) -> int:
        return sum(c.num_bytes for c in self.classes if c.skipped)

    def bytes_of(self, tensor_class: str) -> int:
        return sum(c.num_bytes for c in self.classes if c.tensor_class == tensor_class and not c.skipped)

    @property
    def kv_dtype(self) -> str:
        return self.kv_spec.groups[0].kv_dtype

    @property
    def kv_bytes_per_token(self) -> dict[str, int]:
        """KV bytes one token takes in each layer group (all its layers, K and V)."""
        return {g.name: g.bytes_per_token for g in self.kv_spec.groups}

    @property
    def pool_tokens(self) -> int | None:
        """Tokens of context the KV pool holds (the full-attention groups'; None without a pool)."""
        if self.pool is None:
            return None
        longest = self.pool.max_tokens_per_request
        return longest if longest is not None else min(p.num_tokens for p in self.pool.pools)

    @property
    def kv_pool_bytes(self) -> int:
        return self.pool.num_bytes if self.pool is not None else 0

    @property
    def left_bytes(self) -> int | None:
        """What the budget leaves after weights, reserve and whole KV blocks (None: no budget)."""
        if self.budget_bytes is None:
            return None
        return self.budget_bytes - self.weight_bytes - self.reserved_bytes - self.kv_pool_bytes

    def describe(self) -> str:
        """A table for the start-up log."""
        mib = 2**20
        lines = [(f"Memory: {self.model_type}, weights {self.weights_format}, embedding {self.embedding_dtype},"
                  f" KV cache {self.kv_dtype}"),
                 f"  {'class':<10} {'params':>14} {'MiB':>11}  stored as"]
        for c in self.classes:
            mark = "  (skipped: language model only)" if c.skipped else ""
            lines.append(f"  {c.tensor_class:<10} {c.num_params:>14,} {c.num_bytes / mib:>11.2f}  {c.dtype}{mark}")
        lines.append(f"  {'weights':<10} {'':>14} {self.weight_bytes / mib:>11.2f}")
        for g in self.kv_spec.groups:
            lines.append(f"  KV {g.name}: {g.bytes_per_token:,} B/token ({g.num_layers} layers x {g.kv_tensors}"
                         f" x {g.num_kv_heads} heads x {g.head_dim} x {DTYPE_BYTES[_kv(g.kv_dtype)]} B)"
                         + (f", window {g.sliding_window}" if g.is_sliding else ""))
        if self.pool is not None:
            lines.append(f"  KV pool: {self.pool_tokens:,} tokens, {self.kv_pool_bytes / mib:.2f} MiB")
        left = self.left_bytes
        if self.budget_bytes is not None and left is not None:
            lines.append(f"  budget {self.budget_bytes / mib:.2f} MiB = weights + reserved "
                         f"{self.reserved_bytes / mib:.2f} MiB + KV pool + left {left / mib:.2f} MiB")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers for JSON and metrics."""
        return {
            "model_type": self.model_type, "dtype": self.dtype, "weights_format": self.weights_format,
            "embedding_dtype": self.embedding_dtype, "kv_cache_dtype": self.kv_dtype,
            "memory_bytes": {c.tensor_class: c.num_bytes for c in self.classes if not c.skipped},
            "skipped_bytes": {c.tensor_class: c.num_bytes for c in self.classes if c.skipped},
            "weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv_bytes_per_token,
            "pool_tokens": self.pool_tokens, "kv_pool_bytes": self.kv_pool_bytes,
            "budget_bytes": self.budget_bytes, "left_bytes": self.left_bytes,
        }


def _kv(name: str) -> str:
    return _ALIASES.get(name, name)


def _price(t: TensorShape, dtype: str, fmt: FP8WeightFormat | None, fp8_embedding: bool,
           ) -> tuple[int, int, str]:
    """(bytes of the tensor, bytes of its scales, what it is stored as)."""
    if t.tensor_class in TOWER_CLASSES or t.kind == "vector":
        return t.numel * DTYPE_BYTES[dtype], 0, dtype
    if t.kind == "embedding":
        if fp8_embedding and t.tensor_class in ("embedding", "lm_head"):
            return t.numel, t.shape[0] * SCALE_BYTES, "fp8 (per-row scales)"
        return t.numel * DTYPE_BYTES[dtype], 0, dtype
    if fmt is None or fmt.is_ignored(t.module):
        return t.numel * DTYPE_BYTES[dtype], 0, dtype
    matrices = t.numel // (t.shape[-1] * t.shape[-2])
    return t.numel, matrices * fmt.scale_count(t.shape[-2], t.shape[-1]) * SCALE_BYTES, "fp8"


def memory_breakdown(
    config: Mapping[str, Any],
    *,
    dtype: str = "bfloat16",
    quantization: str | None = None,
    embedding_dtype: str = "auto",
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    language_model_only: bool = False,
    budget_bytes: int | None = None,
    kv_cache_bytes: int | None = None,
    kv_cache_tokens: int | None = None,
    reserved_bytes: int = 0,
) -> MemoryBreakdown:
    """Weights by class, KV spec and pool for the model a config.json describes (see module doc)."""
    dtype = normalize_dtype(dtype)
    emb = normalize_dtype(embedding_dtype, EMBEDDING_DTYPES)
    kv = normalize_dtype(kv_cache_dtype, KV_CACHE_DTYPES)
    if sum(x is not None for x in (budget_bytes, kv_cache_bytes, kv_cache_tokens)) > 1:
        raise ConfigError("size the KV pool by one of: a memory budget, KV cache bytes, KV cache tokens")
    if reserved_bytes < 0:
        raise ConfigError("reserved bytes must be >= 0")
    shape = model_shape(config, block_size)
    fmt = weights_format_for(config, quantization)
    acc: dict[tuple[str, bool], list[Any]] = {}
    for t in shape.tensors:
        skipped = language_model_only and t.tensor_class in TOWER_CLASSES
        num_bytes, scale_bytes, stored = _price(t, dtype, fmt, emb == "fp8")
        row = acc.setdefault((t.tensor_class, skipped), [0, 0, set()])
        row[0] += t.numel
        row[1] += num_bytes
        row[2].add(stored)
        if scale_bytes:
            srow = acc.setdefault(("scales", False), [0, 0, {"float32"}])
            srow[0] += scale_bytes // SCALE_BYTES
            srow[1] += scale_bytes
    classes = tuple(ClassBytes(cls, n, b, "+".join(sorted(s)), skipped)
                    for want in BREAKDOWN_CLASSES for (cls, skipped), (n, b, s) in acc.items() if cls == want)
    spec = shape.kv_spec.with_dtype(dtype if kv == "auto" else kv)
    result = MemoryBreakdown(shape.model_type, dtype, fmt.describe() if fmt else dtype,
                             "fp8 (per-row scales)" if emb == "fp8" else dtype, classes, spec,
                             shape.max_position_embeddings, shape.tie_word_embeddings, None, budget_bytes,
                             reserved_bytes, shape.notes)
    if budget_bytes is not None:
        kv_cache_bytes = budget_bytes - result.weight_bytes - reserved_bytes
        if kv_cache_bytes <= 0:
            raise ConfigError(f"a budget of {budget_bytes / 2**20:.1f} MiB leaves no room for the KV cache:"
                              f" weights take {result.weight_bytes / 2**20:.1f} MiB"
                              f" and {reserved_bytes / 2**20:.1f} MiB are reserved")
    if kv_cache_bytes is not None:
        return replace(result, pool=spec.plan_pools(memory_bytes=kv_cache_bytes))
    if kv_cache_tokens is not None:
        return replace(result, pool=spec.plan_pools(num_tokens=kv_cache_tokens))
    return result
