"""FP8Linear through an injected block GEMM (the runner's GPU path hands in the kernels'
fp8_block_linear; on the CPU its torch reference): the same product as dequantizing, every
block-scaled part sent through the GEMM, and back to dequantizing when it is taken away."""

import pytest
import torch

from chatfleet.engine.kernels.fp8_gemm import fp8_block_linear
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import FP8Linear
from chatfleet.engine.models.fp8_model import use_block_gemm


def _layer(bias: bool) -> FP8Linear:
    torch.manual_seed(0)
    layer = FP8Linear(192, [160, 64, 64], FP8WeightFormat("block", (128, 128)), bias=bias, dtype=torch.float32)
    for i, n in enumerate(layer.part_sizes):
        layer.set_part(i, torch.randn(n, 192) * 0.05)
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias.normal_()
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_block_gemm_matches_dequantizing_and_sees_every_part(bias):
    layer = _layer(bias)
    x = torch.randn(3, 5, 192)
    want = layer(x)
    calls = []

    def gemm(x2, w, s, block):
        calls.append((tuple(w.shape), block))
        return fp8_block_linear(x2, w, s, block)

    holder = torch.nn.Sequential(layer)
    assert use_block_gemm(holder, gemm) == 1
    got = layer(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls == [((160, 192), (128, 128)), ((64, 192), (128, 128)), ((64, 192), (128, 128))]
    use_block_gemm(holder, None)
    calls.clear()
    torch.testing.assert_close(layer(x), want)
    assert not calls


def test_per_channel_layers_keep_their_own_path():
    layer = FP8Linear(64, [32], FP8WeightFormat("channel"), dtype=torch.float32)
    layer.set_part(0, torch.randn(32, 64))
    assert use_block_gemm(torch.nn.Sequential(layer), fp8_block_linear) == 0 and layer.block_gemm is None


def test_the_kernels_path_runner_sends_fp8_linears_through_the_block_gemm():
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model
    from chatfleet.engine.runner.torch_runner import TorchRunner

    loaded = load_model(resolve_model("tiny"), dtype="float32", quantization="fp8")
    layers = [m for m in loaded.model.modules() if isinstance(m, FP8Linear)]
    assert layers and all(m.block_gemm is None for m in layers)
    TorchRunner(loaded, 8, 16, attention="kernels")
    assert all(m.block_gemm is not None for m in layers)
    TorchRunner(loaded, 8, 16, attention="gather")
    assert all(m.block_gemm is None for m in layers)
