"""The decode-rows linear kernel that reads oneDNN's packed weights, against float64 products of
the same operands (the outside oracle) and against oneDNN's own product of the same packed weight;
the layout check that guards it (a weight whose packed bytes do not match is refused); and its
place in ``Linear`` and ``swiglu`` (decode rows take it, prompt rows keep oneDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatfleet.engine.models import packed_gemv as m
from chatfleet.engine.models.linear import Linear
from chatfleet.engine.models.swiglu import GateUpLinear, swiglu

pytestmark = pytest.mark.skipif(not (m.available() and torch.backends.mkldnn.is_available()),
                                reason="no AVX-512 on this CPU (or no C++ compiler)")

ONEDNN = torch.ops.mkldnn._linear_pointwise.default
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.ops.mkldnn._is_mkldnn_bf16_supported() else [])


def _weight(n: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.1).to(dtype)


def _packed(w: torch.Tensor) -> tuple[torch.Tensor, m.PackedLayout]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    layout = m.packed_layout(packed, w)
    if layout is None:
        pytest.skip(f"oneDNN packs {tuple(w.shape)} {w.dtype} in a layout the kernel does not read here")
    return packed, layout


def _onednn_splits_k(dtype: torch.dtype, k: int) -> bool:
    """Whether oneDNN's own product gives a row different bits among 38+ rows than alone here (its
    AMX bf16 product from K = 512, seen on an AMX Xeon)."""
    return dtype == torch.bfloat16 and m.amx_in_use() and k >= 512


def _bound(x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 sums in k order: k float32 ulps of sum |x||w|; bf16 output: plus half a bf16 ulp."""
    mag = x.double().abs() @ w.double().abs().T
    k = x.shape[1]
    out_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
    return mag * (k * 2.0**-24) + mag * out_ulp + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(768, 512), (512, 1536), (100, 73), (7, 5), (64, 16), (130, 200), (8192, 64), (40, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 32, 33, 64])
def test_the_kernel_matches_float64_products(dtype, n, k, rows):
    w = _weight(n, k, dtype, n * k)
    x = _weight(rows, k, dtype, rows + k) * 10
    packed, layout = _packed(w)
    assert (layout.n, layout.k) == (n, k) and layout.k_padded >= k
    assert m.runs(x, layout) == (rows <= m.MAX_ROWS)  # (the kernel itself takes up to KERNEL_MAX_ROWS)
    got = m.packed_linear(x, packed, layout)
    assert got.dtype == dtype and got.shape == (rows, n)
    ref = x.double() @ w.double().T
    assert ((got.double() - ref).abs() <= _bound(x, w, dtype)).all()
    # oneDNN's product of the same packed weight: the same sums to float32 rounding
    theirs = ONEDNN(x, packed, None, "none", [], "")
    assert ((got.double() - theirs.double()).abs() <= 2 * _bound(x, w, dtype)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_and_strided_rows(dtype):
    n, k = 200, 96
    w, b = _weight(n, k, dtype, 1), _weight(1, n, dtype, 2)[0]
    wide = _weight(3, k + 40, dtype, 3) * 10
    x = wide[:, 20 : 20 + k]  # rows k long, k + 40 apart
    packed, layout = _packed(w)
    assert m.runs(x, layout) and x.stride(0) == k + 40
    got = m.packed_linear(x, packed, layout, b)
    ref = x.double() @ w.double().T + b.double()
    assert ((got.double() - ref).abs() <= _bound(x, w, dtype) + b.double().abs() * 2.0**-8).all()


def test_a_weight_that_does_not_match_its_packed_bytes_is_refused():
    w = _weight(128, 64, torch.float32, 4)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    assert m.packed_layout(packed, w) is not None
    other = w.clone()
    other[77, 33] += 1.0  # one value differs from what was packed
    assert m.packed_layout(packed, other) is None
    assert m.packed_layout(packed, w.T.contiguous()) is None  # another shape
    assert m.packed_layout(packed, w.to(torch.float64)) is None  # another dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_check_compares_a_large_weight_a_slice_at_a_time(dtype):
    w = _weight(200, 72, dtype, 12)
    packed, layout = _packed(w)
    raw = m.packed_bytes(packed)
    assert m._matches(raw, w, layout, rows_at_once=64)  # four slices, the last one partial
    other = w.clone()
    other[199, 71] = 3.0  # the last slice's last value
    assert not m._matches(raw, other, layout, rows_at_once=64)


def test_rows_above_the_bound_and_other_inputs_stay_with_onednn():
    w = _weight(64, 32, torch.float32, 5)
    _, layout = _packed(w)
    assert m.runs(torch.zeros(m.MAX_ROWS, 32), layout)
    assert not m.runs(torch.zeros(m.MAX_ROWS + 1, 32), layout)
    assert not m.runs(torch.zeros(1, 32, dtype=torch.float64), layout)
    assert not m.runs(torch.zeros(32, 2).T, layout)  # rows not contiguous
    assert not m.runs(torch.zeros(1, 1, 32), layout)
    assert not m.runs(torch.zeros(1, 32), None)


def test_packed_layout_rejects_impossible_layouts():
    with pytest.raises(ValueError):
        m.PackedLayout(10, 8, 8, 48, torch.float32)
    with pytest.raises(ValueError):
        m.PackedLayout(10, 8, 6, 64, torch.float32)
    with pytest.raises(ValueError):
        m.PackedLayout(10, 7, 7, 64, torch.bfloat16)  # bf16 k steps are pairs


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_linear_takes_the_kernel_for_decode_rows_only(dtype, monkeypatch):
    lin = Linear(96, 160, bias=True)
    with torch.no_grad():
        lin.weight.copy_(_weight(160, 96, torch.float32, 6))
        lin.bias.copy_(_weight(1, 160, torch.float32, 7)[0])
    lin = lin.to(dtype)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.pack()
    assert lin.packed_layout is not None
    calls = []
    real = m.packed_linear
    monkeypatch.setattr(m, "packed_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for rows in (1, m.MAX_ROWS, m.MAX_ROWS + 1, m.MAX_ROWS + 8):
        x = _weight(rows, 96, dtype, rows) * 10
        got = lin(x)
        ref = x.double() @ w.double().T + b.double()
        assert ((got.double() - ref).abs() <= 2 * _bound(x, w, dtype) + b.double().abs() * 2.0**-8).all()
    assert calls == [1, m.MAX_ROWS]


@pytest.mark.skipif(torch.bfloat16 not in DTYPES, reason="no native bf16 here")
@pytest.mark.parametrize("intermediate,hidden", [(1536, 512), (100, 72), (64, 16)])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 21])
def test_swiglu_on_packed_halves_matches_float64_and_onednn(intermediate, hidden, rows):
    g = GateUpLinear(hidden, intermediate)
    with torch.no_grad():
        g.weight.copy_(_weight(2 * intermediate, hidden, torch.float32, intermediate))
    g = g.to(torch.bfloat16)
    w = g.weight.detach().clone()
    g.pack()
    assert g.halves_layout is not None
    x = _weight(rows, hidden, torch.bfloat16, rows) * 10
    got = swiglu(g, x, intermediate)
    many = torch.cat([x] * (m.MAX_ROWS // rows + 1))[: m.MAX_ROWS]  # as many rows as the kernel takes
    assert torch.equal(got, swiglu(g, many, intermediate)[:rows])  # a row's bits are its own
    few = torch.cat([x] * (m.ONEDNN_SAME_BITS_ROWS // rows + 1))[: m.ONEDNN_SAME_BITS_ROWS + 1]
    act = ONEDNN(few, g.packed_halves[0], None, "swish", [], "")
    onednn = torch.ops.mkldnn._linear_pointwise.binary(few, act, g.packed_halves[1], None, "mul")
    assert torch.equal(got, onednn[:rows])  # oneDNN's epilogues at 33 rows (no split K yet): the same bits
    xd = x.double()
    gate, up = xd @ w[:intermediate].double().T, xd @ w[intermediate:].double().T
    ref = F.silu(gate) * up
    # silu(gate) rounded to bf16, then the product rounded: about two bf16 half-ulps, plus the sums'
    gate_bound = _bound(x, w[:intermediate], torch.bfloat16)
    bound = (ref.abs() * 2.0**-7 + gate_bound * up.abs() * 1.1 + _bound(x, w[intermediate:], torch.bfloat16)
             * F.silu(gate).abs() + 1e-6)
    assert ((got.double() - ref).abs() <= bound).all()
    halves = g.packed_halves
    assert halves is not None
    act = ONEDNN(x, halves[0], None, "swish", [], "")
    theirs = torch.ops.mkldnn._linear_pointwise.binary(x, act, halves[1], None, "mul")
    assert ((got.double() - theirs.double()).abs() <= 2 * bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_gets_the_same_bits_at_any_row_count(dtype):
    # steps up to MAX_ROWS take the kernel, larger ones oneDNN: a row's result should not depend on
    # which (the greedy equivalence tests lean on it); the kernel's sums are oneDNN's at a few rows,
    # on tiny's shapes and small's up to K = 512. (At small's down projection, K = 1,536, oneDNN
    # itself gives a row alone and the same row among 40 different bits: it splits K there. On an
    # AMX CPU oneDNN's bf16 product splits K from K = 512 at 38 rows and more, so there a row's
    # bits among 38+ rows in oneDNN are not the kernel's; up to MAX_ROWS they are the kernel's,
    # the same at any row count.)
    for n, k in ((384, 128), (128, 192), (768, 128), (768, 512), (3072, 512), (100, 73)):
        w = _weight(n, k, dtype, n + k)
        packed, layout = _packed(w)
        rows_in_onednn = m.ONEDNN_SAME_BITS_ROWS + 1 if _onednn_splits_k(dtype, k) else 40
        x = _weight(m.MAX_ROWS, k, dtype, k) * 10
        whole = ONEDNN(x[:rows_in_onednn], packed, None, "none", [], "")
        mine = m.packed_linear(x, packed, layout)
        for rows in (1, 2, 5, 13, m.ONEDNN_SAME_BITS_ROWS):
            assert torch.equal(m.packed_linear(x[:rows], packed, layout), whole[:rows]), (n, k, rows)
        for rows in (1, 17, 33, 48, m.MAX_ROWS):
            assert torch.equal(m.packed_linear(x[:rows], packed, layout), mine[:rows]), (n, k, rows)


@pytest.mark.skipif(not m.amx_in_use(), reason="no AMX here (or the OS refused its tile state)")
def test_bf16_sums_on_amx_tiles_are_onednns_bits_and_a_rows_own():
    # small's shapes too (K = 1,536 and 3,072): at decode rows oneDNN's AMX product and the tiles'
    # are the same sums; and a row's bits are the same alone, whatever the other rows in the step
    for n, k in ((1024, 1024), (3072, 1024), (1024, 3072), (6144, 1024), (100, 73), (40, 1), (130, 200)):
        w = _weight(n, k, torch.bfloat16, n * k)
        packed, layout = _packed(w)
        x = _weight(m.MAX_ROWS, k, torch.bfloat16, k) * 10
        for rows in (1, 2, 15, 16, 17, 31, m.ONEDNN_SAME_BITS_ROWS, 33, 48, m.MAX_ROWS):
            got = m.packed_linear(x[:rows], packed, layout)
            if rows <= m.ONEDNN_SAME_BITS_ROWS:
                assert torch.equal(got, ONEDNN(x[:rows], packed, None, "none", [], "")), (n, k, rows)
            assert torch.equal(got, torch.cat([m.packed_linear(x[r : r + 1], packed, layout) for r in range(rows)]))


@pytest.mark.skipif(not m.amx_in_use(), reason="no AMX here (or the OS refused its tile state)")
@pytest.mark.parametrize("rows", [1, 7, 16, 33, m.KERNEL_MAX_ROWS])
def test_bf16_sums_on_avx512_and_amx_both_match_float64_products(rows):
    w = _weight(520, 200, torch.bfloat16, 17)
    x = _weight(rows, 200, torch.bfloat16, 18) * 10
    packed, layout = _packed(w)
    ref = x.double() @ w.double().T
    try:
        for on in (False, True):
            assert m.use_amx(on) == on
            got = m.packed_linear(x, packed, layout)
            assert ((got.double() - ref).abs() <= _bound(x, w, torch.bfloat16)).all(), on
    finally:
        m.use_amx(True)


def test_the_kernel_refuses_more_rows_than_it_holds():
    w = _weight(64, 32, torch.float32, 14)
    packed, layout = _packed(w)
    m.packed_linear(_weight(m.KERNEL_MAX_ROWS, 32, torch.float32, 15), packed, layout)
    with pytest.raises(RuntimeError):
        m.packed_linear(_weight(m.KERNEL_MAX_ROWS + 1, 32, torch.float32, 15), packed, layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [0.01, 1.0, 30.0, 1000.0])  # 1000: exp(-|x|) underflows below ln(FLT_MIN)
def test_the_swish_has_the_bits_of_onednns_post_op(dtype, scale):
    for n, k in ((1536, 512), (100, 73)):
        w = _weight(n, k, dtype, n + 3)
        packed, layout = _packed(w)
        x = _weight(m.MAX_ROWS, k, dtype, k + 5) * scale
        x[0, :] = 0.0  # sums of exactly zero (-0 and +0 alike)
        theirs = ONEDNN(x, packed, None, "swish", [], "")
        for rows in (1, 3, m.MAX_ROWS):
            assert torch.equal(m.packed_linear(x[:rows], packed, layout, swish=True), theirs[:rows]), (n, k, rows)


def test_the_factor_multiplies_after_the_bias():
    w, b = _weight(70, 40, torch.float32, 8), _weight(1, 70, torch.float32, 9)[0]
    packed, layout = _packed(w)
    x, f = _weight(3, 40, torch.float32, 10), _weight(3, 70, torch.float32, 11)
    got = m.packed_linear(x, packed, layout, b, mul=f)
    torch.testing.assert_close(got, (x @ w.T + b) * f, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        m.packed_linear(x, packed, layout, mul=f[:, :60])


def test_without_the_buffer_accessors_every_weight_stays_with_onednn(monkeypatch):
    w = _weight(64, 32, torch.float32, 13)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)

    def missing(_packed):
        raise AttributeError("torch.ops.mkldnn has no data_ptr here")

    monkeypatch.setattr(m, "packed_bytes", missing)
    assert m.packed_layout(packed, w) is None
