"""`chatfleet model tiny --fp8` writes a Hugging Face FP8 checkpoint: e4m3 linears with
block-wise [128, 128] weight_scale_inv, 16-bit embeddings and norms, quantization_config."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open
from typer.testing import CliRunner

from chatfleet.cli.main import app
from chatfleet.engine.builtin_models.tiny import builtin_names


def test_cli_writes_the_hf_fp8_format(tmp_path):
    result = CliRunner().invoke(app, ["model", "tiny", "--out", str(tmp_path / "m"), "--fp8"])
    assert result.exit_code == 0, result.output
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "modules_to_not_convert": None, "weight_block_size": [128, 128]}
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.layers.0.mlp.gate_proj.weight").dtype == torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.mlp.gate_proj.weight_scale_inv").shape == (3, 1)  # 384 x 128
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight_scale_inv").shape == (1, 2)  # 128 x 192
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert sum(n.endswith("weight_scale_inv") for n in names) == 4 * 7
    assert "tiny-fp8" in builtin_names() and "tiny" in builtin_names()
