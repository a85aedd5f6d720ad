"""``--dtype auto``: bfloat16 on a CPU with native bfloat16, float32 on one without, the
checkpoint's dtype on CUDA; the engine loads the model in what it resolves to."""

import pytest
import torch

from chatfleet.engine.config import EngineConfig
from chatfleet.engine.models import dtype as dtypes
from chatfleet.errors import ConfigError


def test_cpu_without_native_bf16_runs_float32(monkeypatch):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "fma"}))
    assert not dtypes.native_bf16(torch.device("cpu"))
    assert dtypes.auto_dtype(torch.device("cpu")) == "float32"


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="oneDNN has no bfloat16 here")
@pytest.mark.parametrize("flag", dtypes.NATIVE_BF16_FLAGS)
def test_cpu_with_native_bf16_runs_bfloat16(monkeypatch, flag):
    monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset({"avx2", flag}))
    assert dtypes.auto_dtype(torch.device("cpu"), "float32") == "bfloat16"  # the checkpoint's is not asked


@pytest.mark.parametrize("checkpoint,expected", [("bfloat16", "bfloat16"), ("torch.float16", "float16"),
                                                 (None, "float32"), ("float64", "float32")])
def test_cuda_takes_the_checkpoint_dtype(checkpoint, expected):
    assert dtypes.auto_dtype(torch.device("cuda", 0), checkpoint) == expected


def test_config_accepts_auto_and_rejects_unknown_names():
    assert EngineConfig(dtype="auto").dtype == "auto"
    with pytest.raises(ConfigError, match="dtype must be one of"):
        EngineConfig(dtype="bf16")


def test_engine_loads_the_model_in_the_resolved_dtype():
    from chatfleet.engine.engine import Engine

    engine = Engine(EngineConfig(model="tiny", dtype="auto", device="cpu", num_threads=1))
    expected = dtypes.auto_dtype(torch.device("cpu"))
    assert engine.runner.model.norm.weight.dtype == getattr(torch, expected)
