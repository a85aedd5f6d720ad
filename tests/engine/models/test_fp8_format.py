"""The FP8 checkpoint formats read from and written to config.json."""

from __future__ import annotations

import pytest

from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.errors import ConfigError


@pytest.mark.parametrize("fmt", [FP8WeightFormat(), FP8WeightFormat("tensor"), FP8WeightFormat("channel"),
                                 FP8WeightFormat("block", (64, 32), ("lm_head",))])
def test_round_trip_through_config_json(fmt):
    assert FP8WeightFormat.from_hf({"quantization_config": fmt.to_hf()}) == fmt


def test_scale_shapes_count_partial_blocks():
    block = FP8WeightFormat()
    assert block.scale_shape(300, 128) == (3, 1) and block.scale_shape(100, 48) == (1, 1)
    assert block.scale_name == "weight_scale_inv"
    assert FP8WeightFormat("channel").scale_shape(300, 128) == (300, 1)
    per_tensor = FP8WeightFormat("tensor")
    assert per_tensor.scale_count(300, 128) == 1 and per_tensor.scale_name == "weight_scale"


def test_unquantized_ignored_and_unsupported():
    assert FP8WeightFormat.from_hf({"model_type": "qwen3"}) is None
    fmt = FP8WeightFormat(ignored=("lm_head", "re:.*layers\\.0\\..*"))
    assert fmt.is_ignored("lm_head") and fmt.is_ignored("model.layers.0.mlp.down_proj")
    assert not fmt.is_ignored("model.layers.1.mlp.down_proj")
    with pytest.raises(ConfigError, match="unsupported quantization method 'awq'"):
        FP8WeightFormat.from_hf({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ConfigError, match="e5m2"):
        FP8WeightFormat.from_hf({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}})
