"""The AMX chunk attention kernel against float32 attention of the same bf16 operands (the outside
oracle), and its chunk invariance: a prompt cut into any chunks gives the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from chatfleet.engine.models import chunk_attention_amx as m
from chatfleet.engine.models.prefill_attention import chunk_attention

pytestmark = pytest.mark.skipif(not m.available(), reason="no AMX on this CPU (or no C++ compiler)")


def _operands(n: int, start: int, hq: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, hq, d, generator=g) * 2).bfloat16()
    k = (torch.randn(hkv, start + n, d, generator=g) * 2).bfloat16()
    v = torch.randn(hkv, start + n, d, generator=g).bfloat16()
    return q, k, v


def _float32_reference(q, k, v, start: int, scale: float) -> torch.Tensor:
    n = q.shape[0]
    pos = torch.arange(start, start + n)
    mask = torch.arange(start + n)[None, :] <= pos[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], k.float()[None], v.float()[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    # bf16 probabilities and a bf16 result: about 2-3 bf16 ulps of the output's scale
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want).abs().max().item() <= 0.02 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("n,start,hq,hkv,d", [(1, 0, 1, 1, 64), (1, 40, 8, 2, 64), (7, 0, 4, 2, 48),
                                              (37, 5, 8, 2, 64), (300, 100, 8, 2, 64), (129, 0, 4, 4, 128),
                                              (50, 33, 16, 2, 80), (17, 0, 2, 1, 256), (64, 1500, 8, 2, 64),
                                              (700, 0, 8, 2, 64), (40, 1100, 4, 1, 128)])
def test_the_kernel_matches_float32_attention(n, start, hq, hkv, d):
    q, k, v = _operands(n, start, hq, hkv, d, n + start + d)
    scale = d**-0.5
    assert m.takes(q, k, v, start, None, 0)
    _close_to_reference(m.chunk_attention_amx(q, k, v, start, scale), _float32_reference(q, k, v, start, scale))


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 70), min_size=1, max_size=6), group=st.sampled_from([1, 2, 4, 8]),
       d=st.sampled_from([16, 48, 64, 128]), seed=st.integers(0, 2**16))
def test_chunking_never_changes_a_bit(cuts, group, d, seed):
    n = sum(cuts)
    q, k, v = _operands(n, 0, 2 * group, 2, d, seed)
    whole = m.chunk_attention_amx(q, k, v, 0, d**-0.5)
    pieces, s = [], 0
    for c in cuts:
        pieces.append(m.chunk_attention_amx(q[s : s + c], k[:, : s + c], v[:, : s + c], s, d**-0.5))
        s += c
    assert torch.equal(torch.cat(pieces), whole)


def test_strided_operands_as_the_engine_passes_them():
    # q a slice of the fused q|k heads, k/v [Hkv, T, D] views of [T, Hkv, D] rows (the first chunk)
    g = torch.Generator().manual_seed(3)
    qk = torch.randn(90, 10, 64, generator=g).bfloat16()
    kv_rows = torch.randn(90, 2, 64, generator=g).bfloat16()
    q, k, v = qk[:, :8], qk[:, 8:].transpose(0, 1), kv_rows.transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous()
    got = m.chunk_attention_amx(q, k, v, 0, 0.125)
    assert torch.equal(got, m.chunk_attention_amx(q.contiguous(), k.contiguous(), v.contiguous(), 0, 0.125))
    _close_to_reference(got, _float32_reference(q, k, v, 0, 0.125))


def test_the_onednn_backend_routes_bf16_chunks_here_and_the_rest_to_the_blocks():
    q, k, v = _operands(40, 8, 8, 2, 64, 1)
    assert torch.equal(chunk_attention(q, k, v, 8, 0.125, "onednn"), m.chunk_attention_amx(q, k, v, 8, 0.125))
    assert not m.takes(q, k, v, 8, 16, 0)  # a sliding window
    assert not m.takes(q.float(), k.float(), v.float(), 8, None, 0)  # float32
    assert not m.takes(q[..., :40], k[..., :40], v[..., :40], 8, None, 0)  # head dim not a multiple of 16
    windowed = chunk_attention(q, k, v, 8, 0.125, "onednn", window=16)
    assert windowed.dtype == torch.bfloat16 and windowed.shape == q.shape


def test_onednn_products_after_the_kernel_are_unaffected():
    # the kernel loads its own tile configuration; oneDNN's AMX matmuls (the linears) load theirs
    from chatfleet.engine.models.linear import onednn_matmul_nt

    g = torch.Generator().manual_seed(5)
    a = torch.randn(300, 512, generator=g).bfloat16()
    b = torch.randn(768, 512, generator=g).bfloat16()
    before = onednn_matmul_nt(a, b)
    q, k, v = _operands(64, 0, 8, 2, 64, 2)
    m.chunk_attention_amx(q, k, v, 0, 0.125)
    assert torch.equal(onednn_matmul_nt(a, b), before)
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True)
    m.chunk_attention_amx(q, k, v, 0, 0.125)
    again = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], is_causal=True, enable_gqa=True)
    assert torch.equal(sdpa, again)


@pytest.mark.parametrize("cuts", [[700, 1, 299, 400], [512, 513, 375], [1, 1399], [128, 129, 127, 1016]])
def test_chunking_never_changes_a_bit_across_key_blocks(cuts):
    """Prompts longer than a key block (the online softmax's 128 keys), cut inside and at blocks."""
    n = sum(cuts)
    q, k, v = _operands(n, 0, 8, 2, 64, n)
    whole = m.chunk_attention_amx(q, k, v, 0, 0.125)
    pieces, s = [], 0
    for c in cuts:
        pieces.append(m.chunk_attention_amx(q[s : s + c], k[:, : s + c], v[:, : s + c], s, 0.125))
        s += c
    assert torch.equal(torch.cat(pieces), whole)
