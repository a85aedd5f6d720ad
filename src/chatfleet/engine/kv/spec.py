"""The one description of the KV cache: layer groups, dtypes, bytes per token, pool sizes.

No torch here: the engine's start-up, the planner's arithmetic (from a config.json alone) and
the start-up log all read the same numbers.

A model's attention layers fall into *layer groups*. Layers of one group share a block table
(one block id addresses the same token range in every layer of the group), a block size, an
attention span (full, or a sliding window) and a KV dtype. A dense model is one group; a
sliding/full hybrid (Gemma) has two; layers that reuse another layer's KV (KV sharing) store
nothing and are in no group.

Sizing: ``KVCacheSpec.plan_pools(memory_bytes=...)`` or ``(num_tokens=...)`` returns a
``PoolPlan``: how many blocks each group's pool gets. One group takes all the memory; several
split it by ``memory_fractions`` (default: in proportion to what each group needs for one
full-length request, see ``default_fractions``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from chatfleet.errors import ConfigError

# Bytes per element of each KV dtype name the engine accepts. "fp8" is e4m3 (OCP FP8).
KV_DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
}


def kv_dtype_bytes(name: str) -> int:
    try:
        return KV_DTYPE_BYTES[name]
    except KeyError:
        raise ConfigError(f"unknown KV cache dtype {name!r}; valid: {', '.join(KV_DTYPE_BYTES)}") from None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerGroupSpec:
    """Attention layers that share one block table, block size, attention span and KV dtype.

    ``sliding_window`` is None for full attention; otherwise a token attends to at most the
    ``sliding_window`` tokens before and including it. ``kv_tensors`` is 2 (separate K and V)
    or 1 (layers whose V is their K, Gemma 4's ``attention_k_eq_v``).
    """

    name: str
    layer_indices: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    block_size: int = 16
    sliding_window: int | None = None
    kv_dtype: str = "float32"
    kv_tensors: int = 2

    def __post_init__(self) -> None:
        if not self.layer_indices:
            raise ConfigError(f"layer group {self.name!r} has no layers")
        if len(set(self.layer_indices)) != len(self.layer_indices):
            raise ConfigError(f"layer group {self.name!r} lists a layer twice")
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ConfigError(f"layer group {self.name!r}: kv heads and head dim must be >= 1")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError(f"layer group {self.name!r}: sliding window must be >= 1")
        if self.kv_tensors not in (1, 2):
            raise ConfigError(f"layer group {self.name!r}: kv_tensors must be 1 or 2")
        kv_dtype_bytes(self.kv_dtype)

    @property
    def num_layers(self) -> int:
        return len(self.layer_indices)

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.kv_tensors * self.num_kv_heads * self.head_dim * kv_dtype_bytes(self.kv_dtype)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes in this group (all its layers, K and V)."""
        return self.num_layers * self.bytes_per_token_per_layer

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one request of ``num_tokens`` needs live in this group's pool.

        Full attention: every block. Sliding: the window's blocks, plus one because the window
        rarely starts on a block boundary (and one more being filled while the oldest slides out).
        """
        full = _ceil_div(num_tokens, self.block_size)
        if self.sliding_window is None:
            return full
        return min(full, _ceil_div(self.sliding_window, self.block_size) + 1)

    def with_dtype(self, kv_dtype: str) -> LayerGroupSpec:
        return LayerGroupSpec(self.name, self.layer_indices, self.num_kv_heads, self.head_dim,
                              self.block_size, self.sliding_window, kv_dtype, self.kv_tensors)


@dataclass(frozen=True)
class GroupPool:
    """One group's pool as planned: blocks, tokens and bytes."""

    group: LayerGroupSpec
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.group.block_size

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.group.bytes_per_block


@dataclass(frozen=True)
class PoolPlan:
    """The pools a memory budget buys: one per layer group, in the spec's group order."""

    pools: tuple[GroupPool, ...]
    budget_bytes: int | None = None  # None when sized by tokens

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pools)

    @property
    def max_tokens_per_request(self) -> int | None:
        """The longest request the full-attention pools can hold (None: no full group)."""
        full = [p.num_tokens for p in self.pools if not p.group.is_sliding]
        return min(full) if full else None

    def pool_of(self, name: str) -> GroupPool:
        for p in self.pools:
            if p.group.name == name:
                return p
        raise KeyError(name)

    def describe(self) -> str:
        """One line for the start-up log."""
        parts = [
            f"{p.group.name}: {p.num_blocks} blocks x {p.group.block_size} = {p.num_tokens} tokens,"
            f" {p.num_bytes / 2**20:.1f} MiB ({p.group.bytes_per_token} B/token, {p.group.num_layers}"
            f" layers, {p.group.kv_dtype}"
            + (f", window {p.group.sliding_window}" if p.group.is_sliding else "") + ")"
            for p in self.pools
        ]
        return "KV pool: " + "; ".join(parts)


@dataclass(frozen=True)
class KVCacheSpec:
    """Every layer group of a model's KV cache."""

    groups: tuple[LayerGroupSpec, ...]
    num_model_layers: int = 0  # layers in the model, KV-sharing ones included (for checks)
    notes: tuple[str, ...] = field(default=())  # e.g. "layers 20..23 reuse KV of layer 19"

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("a KV cache spec needs at least one layer group")
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"layer group names repeat: {names}")
        layers = [i for g in self.groups for i in g.layer_indices]
        if len(set(layers)) != len(layers):
            raise ConfigError("a layer is in two layer groups")

    # ---- builders ------------------------------------------------------------------------------
    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int, *, block_size: int = 16,
                kv_dtype: str = "float32") -> KVCacheSpec:
        """A dense model: every layer full attention, one group."""
        return cls((LayerGroupSpec("full", tuple(range(num_layers)), num_kv_heads, head_dim,
                                   block_size, None, kv_dtype),), num_layers)

    # ---- views ---------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        sizes = {g.block_size for g in self.groups}
        if len(sizes) != 1:
            raise ConfigError(f"layer groups use different block sizes {sorted(sizes)}")
        return sizes.pop()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token in every group (what a token costs where no window applies)."""
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def is_uniform(self) -> bool:
        return len(self.groups) == 1 and not self.groups[0].is_sliding

    def group(self, name: str) -> LayerGroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def with_dtype(self, kv_dtype: str) -> KVCacheSpec:
        return KVCacheSpec(tuple(g.with_dtype(kv_dtype) for g in self.groups), self.num_model_layers,
                           self.notes)

    def bytes_for_request(self, num_tokens: int) -> int:
        """Device KV bytes one request of ``num_tokens`` keeps live (windows applied)."""
        return sum(g.blocks_for(num_tokens) * g.bytes_per_block for g in self.groups)

    # ---- sizing --------------------------------------------------------------------------------
    def default_fractions(self, reference_tokens: int) -> dict[str, float]:
        """Split memory in proportion to what one ``reference_tokens`` request needs per group."""
        need = {g.name: g.blocks_for(reference_tokens) * g.bytes_per_block for g in self.groups}
        total = sum(need.values())
        return {name: n / total for name, n in need.items()}

    def plan_pools(
        self,
        *,
        memory_bytes: int | None = None,
        num_tokens: int | None = None,
        memory_fractions: Mapping[str, float] | None = None,
        reference_tokens: int = 8192,
    ) -> PoolPlan:
        """Blocks per group for a byte budget, or for ``num_tokens`` of full-attention context.

        By tokens, every full group gets ``num_tokens`` worth of blocks and a sliding group the
        same count capped at what its window needs for that many tokens in concurrent requests
        (no cap without a window). By bytes, one group takes all; several split the budget by
        ``memory_fractions`` (names of groups, summing to 1).
        """
        if (memory_bytes is None) == (num_tokens is None):
            raise ConfigError("size the KV pool by memory or by tokens (exactly one)")
        if num_tokens is not None:
            if num_tokens < 1:
                raise ConfigError("the KV pool needs at least one token")
            pools = tuple(GroupPool(g, max(1, num_tokens // g.block_size)) for g in self.groups)
            return PoolPlan(pools)
        assert memory_bytes is not None
        if memory_bytes <= 0:
            raise ConfigError("KV cache memory must be positive")
        fractions = dict(memory_fractions) if memory_fractions else (
            {self.groups[0].name: 1.0} if len(self.groups) == 1 else self.default_fractions(reference_tokens)
        )
        unknown = set(fractions) - {g.name for g in self.groups}
        if unknown or len(fractions) != len(self.groups):
            raise ConfigError(
                f"memory fractions must name each layer group once ({[g.name for g in self.groups]}),"
                f" got {sorted(fractions)}"
            )
        if any(f <= 0 for f in fractions.values()) or abs(sum(fractions.values()) - 1.0) > 1e-6:
            raise ConfigError(f"memory fractions must be positive and sum to 1, got {fractions}")
        group_pools: list[GroupPool] = []
        for g in self.groups:
            n = int(memory_bytes * fractions[g.name]) // g.bytes_per_block
            if n < 1:
                raise ConfigError(
                    f"KV cache memory of {memory_bytes} B holds no block of layer group {g.name!r}"
                    f" ({g.bytes_per_block} B per block)"
                )
            group_pools.append(GroupPool(g, n))
        return PoolPlan(tuple(group_pools), memory_bytes)


def spec_from_layer_kinds(
    layer_kinds: Sequence[str],
    *,
    num_kv_heads: Mapping[str, int],
    head_dim: Mapping[str, int],
    sliding_window: int | None,
    block_size: int = 16,
    kv_dtype: str = "float32",
    kv_tensors: Mapping[str, int] | None = None,
    shared_kv_layers: Sequence[int] = (),
) -> KVCacheSpec:
    """Groups from per-layer kinds ("full_attention" / "sliding_attention", as HF's
    ``layer_types`` names them). Layers in ``shared_kv_layers`` store no KV of their own."""
    by_kind: dict[str, list[int]] = {}
    for i, kind in enumerate(layer_kinds):
        if i in set(shared_kv_layers):
            continue
        if kind not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"layer {i}: unsupported layer type {kind!r}")
        by_kind.setdefault(kind, []).append(i)
    groups = []
    for kind, name in (("full_attention", "full"), ("sliding_attention", "sliding")):
        if kind not in by_kind:
            continue
        groups.append(LayerGroupSpec(
            name, tuple(by_kind[kind]), num_kv_heads[name], head_dim[name], block_size,
            sliding_window if kind == "sliding_attention" else None, kv_dtype,
            (kv_tensors or {}).get(name, 2),
        ))
    notes = (f"{len(shared_kv_layers)} layers reuse earlier layers' KV",) if shared_kv_layers else ()
    return KVCacheSpec(tuple(groups), len(layer_kinds), notes)
