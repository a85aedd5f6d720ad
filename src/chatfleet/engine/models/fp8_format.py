"""How FP8 weights are laid out in Hugging Face checkpoints (no torch here).

An FP8 checkpoint stores each quantized linear's ``weight`` as e4m3 (OCP FP8, largest finite
value 448) plus float32 scales, with ``weight ~= fp8_weight * scale`` element-wise:

- ``block``: ``weight_scale_inv`` of shape ``[ceil(out / 128), ceil(in / 128)]``, one scale per
  ``[128, 128]`` tile (partial tiles at the edges count as whole ones). This is the
  ``quantization_config: {quant_method: fp8, weight_block_size: [128, 128]}`` format of
  DeepSeek-V3 and Qwen3-*-FP8 (despite the name, the stored value multiplies);
- ``tensor``: ``weight_scale`` holding one number (``quant_method: fp8`` without a block size);
- ``channel``: ``weight_scale`` of shape ``[out, 1]`` (``compressed-tensors`` with
  ``strategy: channel``).

Embeddings, lm_head and norms stay in 16 bits; ``modules_to_not_convert`` (HF) /
``ignore`` (compressed-tensors) name more modules left unquantized.
``FP8WeightFormat.from_hf(config)`` reads the format; ``to_hf()`` writes it back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from chatfleet.errors import ConfigError

E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
SCALE_BYTES = 4  # scales are float32
GRANULARITIES = ("block", "tensor", "channel")
DEFAULT_BLOCK = (128, 128)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FP8WeightFormat:
    """Scale granularity of a checkpoint's FP8 linears, and the modules it leaves unquantized."""

    granularity: str = "block"
    block: tuple[int, int] = DEFAULT_BLOCK
    ignored: tuple[str, ...] = ()
    activation_scheme: str = "dynamic"

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ConfigError(f"unknown FP8 scale granularity {self.granularity!r}; valid: {', '.join(GRANULARITIES)}")
        if len(self.block) != 2 or min(self.block) < 1:
            raise ConfigError(f"FP8 weight block must be two positive sizes, got {self.block}")
        if self.activation_scheme not in ("dynamic", "static"):
            raise ConfigError(f"unknown FP8 activation scheme {self.activation_scheme!r}")

    @property
    def scale_name(self) -> str:
        """The scale tensor's name suffix next to ``weight``."""
        return "weight_scale_inv" if self.granularity == "block" else "weight_scale"

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        if self.granularity == "block":
            return (ceil_div(out_features, self.block[0]), ceil_div(in_features, self.block[1]))
        if self.granularity == "channel":
            return (out_features, 1)
        return ()

    def scale_count(self, out_features: int, in_features: int) -> int:
        n = 1
        for s in self.scale_shape(out_features, in_features):
            n *= s
        return n

    def is_ignored(self, module: str) -> bool:
        """Whether ``module`` (an HF module name, e.g. ``model.layers.0.mlp.down_proj``) stays 16-bit."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern) or module.startswith(pattern + "."):
                return True
        return False

    def describe(self) -> str:
        if self.granularity == "block":
            return f"fp8 e4m3, block-wise [{self.block[0]},{self.block[1]}] scales"
        return f"fp8 e4m3, per-{self.granularity} scales"

    # ---- Hugging Face config --------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> FP8WeightFormat | None:
        """The FP8 format a config.json declares, or None for an unquantized checkpoint."""
        qc = config.get("quantization_config")
        if qc is None and isinstance(config.get("text_config"), Mapping):
            qc = config["text_config"].get("quantization_config")
        if not qc:
            return None
        method = qc.get("quant_method")
        if method == "fp8":
            fmt = qc.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise ConfigError(f"FP8 checkpoints in {fmt!r} are not supported; supported: e4m3")
            block = qc.get("weight_block_size")
            ignored = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
            scheme = qc.get("activation_scheme", "dynamic")
            if block:
                return cls("block", (int(block[0]), int(block[1])), ignored, scheme)
            return cls("tensor", DEFAULT_BLOCK, ignored, scheme)
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(qc)
        raise ConfigError(f"unsupported quantization method {method!r}; supported: fp8, compressed-tensors (fp8)")

    @classmethod
    def _from_compressed_tensors(cls, qc: Mapping[str, Any]) -> FP8WeightFormat:
        groups = list((qc.get("config_groups") or {}).values())
        if len(groups) != 1 or not isinstance(groups[0].get("weights"), Mapping):
            raise ConfigError("compressed-tensors checkpoints need exactly one config group with weights")
        w = groups[0]["weights"]
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ConfigError(f"compressed-tensors weights {w.get('type')}/{w.get('num_bits')} bits are not"
                              " supported; supported: float 8 bits (FP8)")
        strategy = w.get("strategy", "tensor")
        if strategy not in GRANULARITIES:
            raise ConfigError(f"compressed-tensors strategy {strategy!r} is not supported; valid: {GRANULARITIES}")
        block = tuple(w.get("block_structure") or DEFAULT_BLOCK)
        acts = groups[0].get("input_activations") or {}
        scheme = "dynamic" if not acts or acts.get("dynamic", True) else "static"
        return cls(strategy, (int(block[0]), int(block[1])), tuple(qc.get("ignore") or ()), scheme)

    def to_hf(self) -> dict[str, Any]:
        """The ``quantization_config`` entry for this format (``quant_method: fp8`` for block and
        tensor granularity; ``compressed-tensors`` for channel, the format that carries it)."""
        if self.granularity == "channel":
            return {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True,
                                "dynamic": False},
                    "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                          "symmetric": True, "dynamic": True},
                }},
                "ignore": list(self.ignored),
            }
        out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme,
                               "modules_to_not_convert": list(self.ignored) or None}
        if self.granularity == "block":
            out["weight_block_size"] = list(self.block)
        return out


def weights_format_for(config: Mapping[str, Any], quantization: str | None) -> FP8WeightFormat | None:
    """The FP8 format the linears end up in: the checkpoint's, or block-wise when quantizing at load."""
    if quantization not in (None, "fp8"):
        raise ConfigError(f"unknown quantization {quantization!r}; valid: fp8 (or none)")
    declared = FP8WeightFormat.from_hf(config)
    if declared is not None or quantization is None:
        return declared
    return FP8WeightFormat()
