"""The row-wise C++ kernels (RMSNorm, silu(gate) * up) against the torch ops they replace: equal
to the last bit (same roundings, torch's summation order, Sleef's exp)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from chatfleet.engine.models import row_ops as m
from chatfleet.engine.models.dtype import native_bf16

pytestmark = pytest.mark.skipif(not m.available(), reason="no C++ compiler: the torch ops run")

BF16_NATIVE = native_bf16(torch.device("cpu"))
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    not BF16_NATIVE, reason="the CPU emulates bfloat16"))]
DTYPE_STRATEGY = st.sampled_from([torch.float32, torch.bfloat16] if BF16_NATIVE else [torch.float32])


@pytest.fixture(autouse=True)
def one_thread():
    """torch's own elementwise results depend on how its threads split a tensor (a split mid-row
    moves its scalar tail); one thread makes them a function of the shape alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    differ = (got != want) & ~nan
    assert not differ.any(), (f"{int(differ.sum())} of {want.numel()} differ, "
                              f"e.g. {got[differ][:4]} vs {want[differ][:4]}")
    # +0 vs -0 compare equal above: the sign bits too
    assert torch.equal(torch.signbit(got) & ~nan, torch.signbit(want) & ~nan)


def _rows(tokens: int, n: int, dtype: torch.dtype, seed: int, scale: float = 3.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, n, generator=g) * scale).to(dtype)
    w = (torch.randn(n, generator=g) * 0.5 + 1).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,n", [(1, 512), (2048, 512), (37, 3072), (5, 1), (3, 7), (4, 8), (9, 15), (2, 16),
                                      (6, 17), (3, 100), (2, 1000), (1, 4096), (1, 70001)])
def test_rms_norm_equals_the_torch_ops(dtype, tokens, n):
    x, w = _rows(tokens, n, dtype, tokens + n)
    assert_same_bits(m.rms_norm(x, w, 1e-6), m.rms_norm_torch(x, w, 1e-6))


@settings(max_examples=60, deadline=None)
@given(dtype=DTYPE_STRATEGY, tokens=st.integers(1, 40), n=st.integers(1, 2500), seed=st.integers(0, 2**31),
       log_scale=st.floats(-30, 30), eps=st.sampled_from([1e-6, 1e-5, 0.0]))
def test_rms_norm_equals_the_torch_ops_over_shapes_and_scales(dtype, tokens, n, seed, log_scale, eps):
    x, w = _rows(tokens, n, dtype, seed, 2.0**log_scale)
    assert_same_bits(m.rms_norm(x, w, eps), m.rms_norm_torch(x, w, eps))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_subnormals_zeros_and_specials(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([[tiny / 4] * 40, [tiny * 3] * 20 + [-tiny / 2] * 20, [0.0] * 40, [-0.0] * 40,
                      [1e30] * 40, [float("inf")] + [1.0] * 39, [float("nan")] + [1.0] * 39]).to(dtype)
    w = torch.linspace(-2, 2, 40).to(dtype)
    for eps in (1e-6, 0.0):
        assert_same_bits(m.rms_norm(x, w, eps), m.rms_norm_torch(x, w, eps))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_and_batched_inputs(dtype):
    x, w = _rows(12, 96, dtype, 7)
    rows = x[:, :64]  # rows of 64 every 96: the kernel reads them in place
    assert_same_bits(m.rms_norm(rows, w[:64], 1e-6), m.rms_norm_torch(rows, w[:64], 1e-6))
    batched = x.view(3, 4, 96)  # contiguous, 3-D
    assert_same_bits(m.rms_norm(batched, w, 1e-6), m.rms_norm_torch(batched, w, 1e-6))
    columns = x.t().contiguous().t()  # column-major rows: the torch ops run (which sum them in another order)
    assert_same_bits(m.rms_norm(columns, w, 1e-6), m.rms_norm_torch(columns, w, 1e-6))
    odd = x[:, ::2]  # a stride inside the row: the torch ops run
    assert_same_bits(m.rms_norm(odd, w[:48], 1e-6), m.rms_norm_torch(odd, w[:48], 1e-6))


@settings(max_examples=60, deadline=None)
@given(dtype=DTYPE_STRATEGY, tokens=st.integers(1, 40), n=st.integers(1, 2500), seed=st.integers(0, 2**31),
       log_scale=st.floats(-30, 30))
def test_add_rms_norm_equals_the_add_then_the_torch_norm(dtype, tokens, n, seed, log_scale):
    x, w = _rows(tokens, n, dtype, seed, 2.0**log_scale)
    residual, _ = _rows(tokens, n, dtype, seed + 1, 2.0**log_scale)
    want_sum = x.clone().add_(residual)
    want = m.rms_norm_torch(want_sum, w, 1e-6)
    got = m.add_rms_norm(x, residual, w, 1e-6)
    assert_same_bits(got, want)
    assert_same_bits(x, want_sum)  # x became the residual stream, in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_of_specials_and_of_inputs_it_does_not_take(dtype):
    tiny = torch.finfo(dtype).tiny
    x = torch.tensor([[tiny / 4] * 40, [1e30] * 40, [float("inf")] + [1.0] * 39, [float("nan")] + [1.0] * 39,
                      [0.0] * 40]).to(dtype)
    residual = torch.tensor([[tiny / 4] * 40, [1e30] * 40, [-float("inf")] + [1.0] * 39, [1.0] * 40,
                             [-0.0] * 40]).to(dtype)
    w = torch.linspace(-2, 2, 40).to(dtype)
    want = m.rms_norm_torch(x.clone().add_(residual), w, 1e-6)
    assert_same_bits(m.add_rms_norm(x.clone(), residual, w, 1e-6), want)
    strided = torch.cat([x, x], dim=1)[:, :40]  # rows not contiguous: the torch ops run, same result
    assert_same_bits(m.add_rms_norm(strided, residual, w, 1e-6), want)


def _gate_up(tokens: int, inter: int, dtype: torch.dtype, seed: int, scale: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, 2 * inter, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,inter", [(1, 1536), (2048, 1536), (7, 3072), (3, 1), (5, 15), (4, 24), (6, 50),
                                          (2, 100), (3, 1573)])
def test_silu_and_mul_equals_the_torch_ops(dtype, tokens, inter):
    gate_up = _gate_up(tokens, inter, dtype, tokens * inter)
    assert_same_bits(m.silu_and_mul(gate_up, inter), m.silu_and_mul_torch(gate_up, inter))


@settings(max_examples=60, deadline=None)
@given(dtype=DTYPE_STRATEGY, tokens=st.integers(1, 30), inter=st.integers(1, 700), seed=st.integers(0, 2**31),
       log_scale=st.floats(-20, 8))
def test_silu_and_mul_equals_the_torch_ops_over_shapes_and_scales(dtype, tokens, inter, seed, log_scale):
    gate_up = _gate_up(tokens, inter, dtype, seed, 2.0**log_scale)
    assert_same_bits(m.silu_and_mul(gate_up, inter), m.silu_and_mul_torch(gate_up, inter))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_over_every_exponent_and_the_specials(dtype):
    """Gates over the whole exp range (both sides of Sleef's -104 / 100 cut-offs and of the
    subnormals), with up = 1 and up = 3, in whole vector chunks and in the scalar tail."""
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -104.0, 100.0, 88.72, -87.3])
    gates = torch.cat([torch.linspace(-120, 120, 200_003), torch.logspace(-45, 38, 5_000),
                       -torch.logspace(-45, 38, 5_000), specials])
    gates = gates.to(dtype)
    for up_value in (1.0, 3.0):
        gate_up = torch.cat([gates, torch.full_like(gates, up_value)]).view(1, -1)
        assert_same_bits(m.silu_and_mul(gate_up, gates.numel()), m.silu_and_mul_torch(gate_up, gates.numel()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_bfloat16_gate(dtype):
    """Every 16-bit pattern as a gate (in bfloat16: every value; in float32: their widenings)."""
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).to(dtype)
    gate_up = torch.cat([gates.view(-1, 64), torch.full((1024, 64), 1.5, dtype=dtype)], dim=1)
    assert_same_bits(m.silu_and_mul(gate_up, 64), m.silu_and_mul_torch(gate_up, 64))


def test_the_model_shapes_run_the_kernels(monkeypatch):
    """The comparisons above test the kernels, not the fallback: the layer's shapes reach them."""
    def refuse(*args):
        raise AssertionError("the torch ops ran")

    monkeypatch.setattr(m, "rms_norm_torch", refuse)
    monkeypatch.setattr(m, "silu_and_mul_torch", refuse)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = _rows(16, 512, dtype, 0)
        m.rms_norm(x, w, 1e-6)
        m.rms_norm(x[:, :256], w[:256], 1e-6)
        m.silu_and_mul(_gate_up(16, 1536, dtype, 0), 1536)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
def test_inputs_the_kernels_do_not_take_run_the_torch_ops():
    gate_up = _gate_up(6, 40, torch.float32, 3)
    columns = gate_up.t().contiguous().t()
    assert_same_bits(m.silu_and_mul(columns, 40), m.silu_and_mul_torch(columns, 40))
    assert_same_bits(m.silu_and_mul(gate_up.view(2, 3, 80), 40), m.silu_and_mul_torch(gate_up.view(2, 3, 80), 40))
    half = gate_up.half()  # another dtype
    assert_same_bits(m.silu_and_mul(half, 40), m.silu_and_mul_torch(half, 40))
    x, w = _rows(4, 32, torch.float32, 1)
    assert_same_bits(m.rms_norm(x, w.double(), 1e-6), m.rms_norm_torch(x, w.double(), 1e-6))  # mixed dtypes
    assert_same_bits(m.rms_norm(x.half(), w.half(), 1e-6), m.rms_norm_torch(x.half(), w.half(), 1e-6))


def test_autograd_runs_the_torch_ops():
    x, w = _rows(4, 32, torch.float32, 2)
    w.requires_grad_(True)
    y = m.rms_norm(x, w, 1e-6)
    assert y.grad_fn is not None
    y.sum().backward()
    assert w.grad is not None
    with torch.no_grad():
        assert m.rms_norm(x, w, 1e-6).grad_fn is None


def test_the_kernels_stay_off_with_chatfleet_no_cpu_kernel(monkeypatch, request):
    monkeypatch.setenv("CHATFLEET_NO_CPU_KERNEL", "1")
    m._LOADER.reset()
    request.addfinalizer(m._LOADER.reset)  # later tests load the kernels again (from the build cache)
    assert not m.available()
    calls = []
    monkeypatch.setattr(m, "rms_norm_torch", lambda *a: calls.append("norm") or torch.zeros(1))
    monkeypatch.setattr(m, "silu_and_mul_torch", lambda *a: calls.append("silu") or torch.zeros(1))
    x, w = _rows(4, 32, torch.float32, 1)
    m.rms_norm(x, w, 1e-6)
    m.silu_and_mul(_gate_up(4, 16, torch.float32, 1), 16)
    assert calls == ["norm", "silu"]
