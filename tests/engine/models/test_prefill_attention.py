"""oneDNN chunk attention equals PyTorch's SDPA (causal, with and without a cached prefix)."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.models.linear import Linear, onednn_available
from chatfleet.engine.models.prefill_attention import QUERY_BLOCK, chunk_attention

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32), reason="no oneDNN")


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (8, 2, 64), (6, 1, 40)])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 37), (0, QUERY_BLOCK), (0, 2 * QUERY_BLOCK + 5),
                                     (11, 2), (50, QUERY_BLOCK + 1), (300, 90)])
def test_onednn_equals_sdpa(heads, kv_heads, head_dim, start, n):
    g = torch.Generator().manual_seed(start * 1000 + n)
    q = torch.randn(n, heads, head_dim, generator=g)
    k = torch.randn(kv_heads, start + n, head_dim, generator=g)
    v = torch.randn(kv_heads, start + n, head_dim, generator=g)
    scale = head_dim**-0.5
    ref = chunk_attention(q, k, v, start, scale, "torch")
    out = chunk_attention(q, k, v, start, scale, "onednn")
    assert out.shape == (n, heads, head_dim)
    assert (out - ref).abs().max().item() < 1e-5


def test_onednn_strided_keys_and_bfloat16():
    """Keys as a slice of a wider buffer (rows contiguous per head), and bf16 inputs."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(200, 8, 32, generator=g)
    kbuf, vbuf = torch.randn(2, 400, 32, generator=g), torch.randn(2, 400, 32, generator=g)
    k, v = kbuf[:, :260], vbuf[:, :260]
    ref = chunk_attention(q, k.contiguous(), v.contiguous(), 60, 0.2, "torch")
    assert (chunk_attention(q, k, v, 60, 0.2, "onednn") - ref).abs().max().item() < 1e-5
    if onednn_available(torch.device("cpu"), torch.bfloat16):
        out = chunk_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 60, 0.2, "onednn")
        assert out.dtype == torch.bfloat16
        assert (out.float() - ref).abs().max().item() < 0.05


def test_packed_linear_equals_plain():
    torch.manual_seed(0)
    lin = Linear(48, 40, bias=True)
    with torch.no_grad():
        lin.weight.normal_()
        lin.bias.normal_()
    x = torch.randn(7, 48)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)
    lin.pack()
    assert lin.weight is None and "weight" not in dict(lin.named_parameters())
    assert (lin(x) - ref).abs().max().item() < 1e-4
