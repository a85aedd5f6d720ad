"""Backend resolution: the reference wherever the kernel cannot run, unless triton is forced."""

import pytest
import torch

from chatfleet.engine.kernels import backend
from chatfleet.engine.kernels.attention_params import AttentionParams
from chatfleet.engine.kernels.backend import KernelUnsupported, next_pow2, resolve_backend
from chatfleet.errors import ConfigError


def test_cpu_tensors_take_the_reference_under_auto(monkeypatch):
    x = torch.zeros(2)
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        assert resolve_backend("auto", (x,)) == "torch"
    assert resolve_backend("torch", (x,)) == "torch"


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KernelUnsupported, match="CUDA"):
        resolve_backend("triton", (x,))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", (x,)) == "triton"


def test_kernel_reasons_and_missing_triton_fall_back_or_raise(monkeypatch):
    x = torch.zeros(2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    with pytest.raises(KernelUnsupported, match="odd dtype"):
        resolve_backend("triton", (x,), "odd dtype")
    monkeypatch.setattr(backend, "triton_available", lambda: False)
    with pytest.raises(KernelUnsupported, match="not installed"):
        resolve_backend("triton", (x,))


def test_env_override_and_unknown_backend(monkeypatch):
    monkeypatch.setattr(backend, "triton_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x = torch.zeros(2)
    assert resolve_backend("auto", (x,)) == "triton"
    monkeypatch.setenv("CHATFLEET_KERNELS", "torch")
    assert resolve_backend("auto", (x,)) == "torch"
    assert resolve_backend("triton", (x,)) == "triton"  # forcing wins over the switch
    with pytest.raises(ConfigError, match="unknown kernel backend"):
        resolve_backend("cuda", (x,))


def test_helpers_and_params_validation():
    assert [next_pow2(n) for n in (1, 2, 3, 16, 17)] == [1, 2, 4, 16, 32]
    for bad in ({"scale": 0.0}, {"scale": 1.0, "window": 0}, {"scale": 1.0, "softcap": -1.0},
                {"scale": 1.0, "k_scale": 0.0}):
        with pytest.raises(ConfigError):
            AttentionParams(**bad)
