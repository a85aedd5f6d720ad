"""The AVX-512 chunk attention kernel against float64 attention of the same operands (the outside
oracle), and its chunk invariance: a prompt cut into any chunks gives the same bits. bf16 operands
(widened to float32, the result rounded once) against the same oracle, to bf16's rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from chatfleet.engine.models import chunk_attention_amx as amx
from chatfleet.engine.models import chunk_attention_avx512 as m
from chatfleet.engine.models.prefill_attention import chunk_attention, runs_in_onednn

pytestmark = pytest.mark.skipif(not m.available(), reason="no AVX-512 on this CPU (or no C++ compiler)")


def _operands(n: int, start: int, hq: int, hkv: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g) * 2
    k = torch.randn(hkv, start + n, d, generator=g) * 2
    v = torch.randn(hkv, start + n, d, generator=g)
    return q, k, v


def _float64_reference(q, k, v, start: int, scale: float) -> torch.Tensor:
    n = q.shape[0]
    pos = torch.arange(start, start + n)
    mask = torch.arange(start + n)[None, :] <= pos[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k.double()[None], v.double()[None],
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def _close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 products and exp: a few float32 ulps of the output's scale (the oneDNN blocks: the same)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got.double() - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("n,start,hq,hkv,d", [(1, 0, 1, 1, 64), (1, 40, 8, 2, 64), (7, 0, 4, 2, 48),
                                              (37, 5, 8, 2, 64), (300, 100, 8, 2, 64), (129, 0, 4, 4, 128),
                                              (50, 33, 16, 2, 80), (33, 3, 6, 3, 112), (17, 0, 2, 1, 256),
                                              (40, 0, 4, 1, 192), (64, 0, 8, 8, 16), (9, 20, 5, 1, 96)])
def test_the_kernel_matches_float64_attention(n, start, hq, hkv, d):
    q, k, v = _operands(n, start, hq, hkv, d, n + start + d)
    scale = d**-0.5
    assert m.takes(q, k, v, start, None, 0)
    _close_to_reference(m.chunk_attention_avx512(q, k, v, start, scale), _float64_reference(q, k, v, start, scale))


def test_large_scores_and_a_long_context_stay_accurate():
    # scores far apart (exp underflow for most keys) and 1,500 keys: softmax's maximum and sum per row
    q, k, v = _operands(200, 1300, 8, 2, 64, 11)
    q = q * 8
    _close_to_reference(m.chunk_attention_avx512(q, k, v, 1300, 0.125), _float64_reference(q, k, v, 1300, 0.125))


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(1, 70), min_size=1, max_size=6), group=st.sampled_from([1, 2, 3, 4, 8]),
       d=st.sampled_from([16, 48, 64, 128]), seed=st.integers(0, 2**16))
def test_chunking_never_changes_a_bit(cuts, group, d, seed):
    n = sum(cuts)
    q, k, v = _operands(n, 0, 2 * group, 2, d, seed)
    whole = m.chunk_attention_avx512(q, k, v, 0, d**-0.5)
    pieces, s = [], 0
    for c in cuts:
        pieces.append(m.chunk_attention_avx512(q[s : s + c], k[:, : s + c], v[:, : s + c], s, d**-0.5))
        s += c
    assert torch.equal(torch.cat(pieces), whole)


def test_strided_operands_as_the_engine_passes_them():
    # q a slice of the fused q|k heads, k/v [Hkv, T, D] views of [T, Hkv, D] rows (the first chunk)
    g = torch.Generator().manual_seed(3)
    qk = torch.randn(90, 10, 64, generator=g)
    kv_rows = torch.randn(90, 2, 64, generator=g)
    q, k, v = qk[:, :8], qk[:, 8:].transpose(0, 1), kv_rows.transpose(0, 1)
    assert not q.is_contiguous() and not k.is_contiguous()
    got = m.chunk_attention_avx512(q, k, v, 0, 0.125)
    assert torch.equal(got, m.chunk_attention_avx512(q.contiguous(), k.contiguous(), v.contiguous(), 0, 0.125))
    _close_to_reference(got, _float64_reference(q, k, v, 0, 0.125))


def test_the_onednn_backend_routes_float32_chunks_here_and_the_rest_to_the_blocks():
    q, k, v = _operands(40, 8, 8, 2, 64, 1)
    assert torch.equal(chunk_attention(q, k, v, 8, 0.125, "onednn"), m.chunk_attention_avx512(q, k, v, 8, 0.125))
    assert not m.takes(q, k, v, 8, 16, 0)  # a sliding window
    assert not m.takes(q, k[:, 8:], v[:, 8:], 8, None, 8)  # keys not from position 0
    assert not m.takes(q.half(), k.half(), v.half(), 8, None, 0)  # float16
    assert not m.takes(q.bfloat16(), k, v, 8, None, 0)  # mixed dtypes
    assert not m.takes(q[..., :40], k[..., :40], v[..., :40], 8, None, 0)  # head dim not compiled
    windowed = chunk_attention(q, k, v, 8, 0.125, "onednn", window=16)
    assert windowed.dtype == torch.float32 and windowed.shape == q.shape
    _close_to_reference(chunk_attention(q, k, v, 8, 0.125, "torch"), _float64_reference(q, k, v, 8, 0.125))


PAIR_DOTS = [pytest.param(False, id="widened"),
             pytest.param(True, id="pair_dots", marks=pytest.mark.skipif(
                 not m.available() or not m.has_pair_dots(), reason="no AVX512_BF16 on this CPU"))]


def _close_to_reference_in_bf16(got: torch.Tensor, want: torch.Tensor, want_abs: torch.Tensor, pair_dots: bool) -> None:
    """Widened: float32 attention rounded to bf16 once, within half a bf16 ulp (2^-8 relative) of the
    exact value plus float32's error. Pair dots: each softmax numerator is rounded to bf16 too (2^-8
    relative), which moves the output by at most 2^-8 of the weighted sum of |V| (``want_abs``)."""
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    err = (got.double() - want).abs()
    bound = want.abs() * 2.0**-8 + 2e-5 * max(1.0, want.abs().max().item())
    if pair_dots:
        bound = bound + want_abs * 2.0**-8
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("pair_dots", PAIR_DOTS)
@pytest.mark.parametrize("n,start,hq,hkv,d", [(1, 0, 1, 1, 64), (1, 40, 8, 2, 64), (37, 5, 8, 2, 64),
                                              (300, 100, 8, 2, 64), (129, 0, 4, 4, 128), (33, 3, 6, 3, 112),
                                              (17, 0, 2, 1, 256), (9, 20, 5, 1, 96), (7, 0, 4, 2, 48),
                                              (64, 0, 8, 8, 16), (200, 1300, 8, 2, 64), (2, 1, 2, 1, 32)])
def test_bf16_operands_match_float64_attention(n, start, hq, hkv, d, pair_dots):
    q, k, v = (t.bfloat16() for t in _operands(n, start, hq, hkv, d, n + start + d))
    assert m.takes(q, k, v, start, None, 0)
    got = m.chunk_attention_avx512(q, k, v, start, d**-0.5, pair_dots=pair_dots)
    want = _float64_reference(q, k, v, start, d**-0.5)  # of the bf16 values
    _close_to_reference_in_bf16(got, want, _float64_reference(q, k, v.abs(), start, d**-0.5), pair_dots)


def test_pair_dots_are_the_default_where_built():
    q, k, v = (t.bfloat16() for t in _operands(40, 8, 8, 2, 64, 4))
    chosen = m.chunk_attention_avx512(q, k, v, 8, 0.125)
    assert torch.equal(chosen, m.chunk_attention_avx512(q, k, v, 8, 0.125, pair_dots=m.has_pair_dots()))


@pytest.mark.parametrize("pair_dots", PAIR_DOTS)
@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(1, 70), min_size=1, max_size=6), group=st.sampled_from([1, 2, 4]),
       d=st.sampled_from([16, 48, 64, 128]), seed=st.integers(0, 2**16))
def test_bf16_chunking_never_changes_a_bit(pair_dots, cuts, group, d, seed):
    n = sum(cuts)
    q, k, v = (t.bfloat16() for t in _operands(n, 0, 2 * group, 2, d, seed))
    whole = m.chunk_attention_avx512(q, k, v, 0, d**-0.5, pair_dots=pair_dots)
    pieces, s = [], 0
    for c in cuts:
        pieces.append(m.chunk_attention_avx512(q[s : s + c], k[:, : s + c], v[:, : s + c], s, d**-0.5,
                                               pair_dots=pair_dots))
        s += c
    assert torch.equal(torch.cat(pieces), whole)


@pytest.mark.parametrize("pair_dots", PAIR_DOTS)
def test_bf16_strided_operands_as_the_engine_passes_them(pair_dots):
    g = torch.Generator().manual_seed(5)
    qk = torch.randn(70, 10, 64, generator=g).bfloat16()
    kv_rows = torch.randn(70, 2, 64, generator=g).bfloat16()
    q, k, v = qk[:, :8], qk[:, 8:].transpose(0, 1), kv_rows.transpose(0, 1)
    got = m.chunk_attention_avx512(q, k, v, 0, 0.125, pair_dots=pair_dots)
    assert torch.equal(got, m.chunk_attention_avx512(q.contiguous(), k.contiguous(), v.contiguous(), 0, 0.125,
                                                     pair_dots=pair_dots))
    _close_to_reference_in_bf16(got, _float64_reference(q, k, v, 0, 0.125),
                                _float64_reference(q, k, v.abs(), 0, 0.125), pair_dots)


@pytest.mark.skipif(amx.available(), reason="bf16 chunks take the AMX kernel on this CPU")
def test_without_amx_the_onednn_backend_routes_bf16_chunks_here_not_to_the_blocks():
    q, k, v = (t.bfloat16() for t in _operands(40, 8, 8, 2, 64, 2))
    assert torch.equal(chunk_attention(q, k, v, 8, 0.125, "onednn"), m.chunk_attention_avx512(q, k, v, 8, 0.125))
    assert not runs_in_onednn(torch.bfloat16, 64)  # so the row buckets' primitives get their cache
    assert runs_in_onednn(torch.bfloat16, 40)  # a head dim not compiled
