"""Per-layer K and V scales of an FP8 KV cache: read from a checkpoint, defaulted, or measured.

An FP8 cache stores ``k / k_scale`` (and ``v / v_scale``) as e4m3 clamped to +-448, and attention
reads ``fp8 * scale``. One scale per layer and tensor, so moving raw cache bytes (host tier,
preemption) needs nothing else.

Checkpoint names, as vLLM's loader accepts them (layer ``N``):
``model.layers.N.self_attn.{k,v}_scale``, ``...self_attn.attn.{k,v}_scale``,
``...self_attn.{k,v}_proj.{k,v}_scale`` (ModelOpt), ``...self_attn.qkv_proj.{k,v}_scale``,
``...self_attn.{k,v}_proj.output_scale`` (AutoFP8) and the deprecated ``...self_attn.kv_scale``
(one scale for both). ``q_scale`` / ``prob_scale`` are recognised and ignored.
Without scales the cache uses 1.0 (``KVScales.ones``) and the runner logs one warning; the
engine can instead measure them from the first prompt tokens (``amax / 448`` per layer, seen by
an observer on each attention layer: ``kv_calibration.measure_kv_scales``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from chatfleet.engine.models.fp8_format import E4M3_MAX
from chatfleet.errors import ConfigError

_KV_SCALE_RE = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|qkv_proj\.|[kv]_proj\.)?(k|v|kv)_scale$")
_OUTPUT_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_proj\.output_scale$")
_IGNORED_RE = re.compile(r"^model\.layers\.\d+\.self_attn\.(?:attn\.|qkv_proj\.|q_proj\.)?(q|prob)_scale$")

MISSING_SCALES_WARNING = (
    "FP8 KV cache: the checkpoint has no k_scale/v_scale tensors; using scale 1.0 for every layer."
    " Values beyond +-448 are clipped and small ones lose precision; pass --kv-scales-from-prompts N"
    " to measure scales from the first N prompt tokens, or use a checkpoint with KV scales."
)


def match_kv_scale(name: str) -> tuple[int, str] | None:
    """``(layer, "k" | "v" | "kv")`` for a KV scale tensor name, ``(-1, "ignored")`` for q/prob
    scales, None for any other tensor."""
    m = _KV_SCALE_RE.match(name) or _OUTPUT_SCALE_RE.match(name)
    if m:
        return int(m.group(1)), m.group(2)
    if _IGNORED_RE.match(name):
        return -1, "ignored"
    return None


@dataclass(frozen=True)
class KVScales:
    """One K and one V scale per layer, and where they came from."""

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str  # "checkpoint", "default" (1.0) or "prompts"

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ConfigError("KV scales: one K and one V scale per layer")
        if any(not s > 0 for s in self.k + self.v):
            raise ConfigError(f"KV scales must be positive, got k={self.k} v={self.v}")

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers, "default")

    @classmethod
    def from_checkpoint(cls, found: dict[tuple[int, str], float], num_layers: int) -> KVScales | None:
        """Scales from ``{(layer, "k"|"v"|"kv"): value}``; None if the checkpoint had none."""
        if not found:
            return None
        k, v = [], []
        for layer in range(num_layers):
            both = found.get((layer, "kv"))
            ks, vs = found.get((layer, "k"), both), found.get((layer, "v"), both)
            if ks is None or vs is None:
                raise ConfigError(f"the checkpoint has KV scales for some layers but not for layer {layer}")
            k.append(float(ks))
            v.append(float(vs))
        return cls(tuple(k), tuple(v), "checkpoint")

    @classmethod
    def from_amax(cls, k_amax: list[float], v_amax: list[float]) -> KVScales:
        """``amax / 448`` per layer (1.0 where a layer saw only zeros)."""
        def scale(a: float) -> float:
            return a / E4M3_MAX if a > 0 else 1.0

        return cls(tuple(scale(a) for a in k_amax), tuple(scale(a) for a in v_amax), "prompts")

    def describe(self) -> str:
        return (f"KV scales from {self.source}: k {min(self.k):.4g}..{max(self.k):.4g},"
                f" v {min(self.v):.4g}..{max(self.v):.4g}")
