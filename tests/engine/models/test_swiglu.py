"""The SwiGLU projection: packed in bfloat16 it runs silu and the product in oneDNN's epilogues.
Oracle: the float64 product of the same bf16 weights and inputs; the fused form must lie within
two bf16 roundings of it (the activated gate, then the product) and no farther from it than the
unfused path (three: gate_up, silu, product); each row's result must not depend on the rows
beside it (greedy equivalence across batching rests on that); float32 and unpacked projections
keep the unfused path, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from chatfleet.engine.models.dtype import native_bf16
from chatfleet.engine.models.linear import onednn_available
from chatfleet.engine.models.row_ops import silu_and_mul
from chatfleet.engine.models.swiglu import GateUpLinear, swiglu

HIDDEN, INTER = 192, 320


@pytest.fixture(autouse=True)
def inference() -> Iterator[None]:
    with torch.inference_mode():
        yield
ONEDNN_BF16 = onednn_available(torch.device("cpu"), torch.bfloat16) and native_bf16(torch.device("cpu"))


def projection(dtype: torch.dtype, seed: int = 0) -> GateUpLinear:
    gen = torch.Generator().manual_seed(seed)
    proj = GateUpLinear(HIDDEN, INTER)
    with torch.no_grad():
        plain_weight(proj).copy_(torch.randn(2 * INTER, HIDDEN, generator=gen) * 0.08)
    return proj.to(dtype)


def plain_weight(proj: GateUpLinear) -> torch.Tensor:
    assert proj.weight is not None
    return proj.weight


def inputs(rows: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


def reference(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    gate_up = x.double() @ weight.double().T
    return torch.nn.functional.silu(gate_up[:, :INTER]) * gate_up[:, INTER:]


@pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bfloat16 on this CPU")
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_bf16_is_within_two_roundings_of_float64(rows: int) -> None:
    proj = projection(torch.bfloat16)
    weight = plain_weight(proj).detach().clone()
    x = inputs(rows, torch.bfloat16)
    unfused = silu_and_mul(proj(x), INTER)
    proj.pack()
    assert proj.packed_halves is not None and proj.weight is None  # no plain copy kept
    got = swiglu(proj, x, INTER)
    want = reference(weight, x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, INTER)
    err = (got.double() - want).abs()
    assert bool((err <= want.abs() * 2.0**-7 + 1e-6).all()), float(err.max())
    assert float(err.max()) <= float((unfused.double() - want).abs().max())


@pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bfloat16 on this CPU")
def test_packed_bf16_rows_do_not_depend_on_their_neighbours() -> None:
    proj = projection(torch.bfloat16)
    proj.pack()
    x = inputs(300, torch.bfloat16)
    whole = swiglu(proj, x, INTER)
    for lo, hi in [(0, 1), (5, 6), (0, 8), (17, 49), (100, 300), (299, 300)]:
        assert torch.equal(swiglu(proj, x[lo:hi].contiguous(), INTER), whole[lo:hi])


@pytest.mark.skipif(not ONEDNN_BF16, reason="no oneDNN bfloat16 on this CPU")
def test_packed_bf16_forward_still_returns_gate_then_up() -> None:
    proj = projection(torch.bfloat16)
    weight = plain_weight(proj).detach().clone()
    x = inputs(9, torch.bfloat16)
    proj.pack()
    got = proj(x)
    want = x.double() @ weight.double().T
    assert got.shape == (9, 2 * INTER)
    assert bool(((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-6).all())


@pytest.mark.parametrize("pack", [False, True])
def test_float32_keeps_the_unfused_path(pack: bool) -> None:
    proj = projection(torch.float32)
    x = inputs(13, torch.float32)
    if pack:
        if not onednn_available(torch.device("cpu"), torch.float32):
            pytest.skip("no oneDNN")
        proj.pack()
        assert proj.packed_halves is None and proj.packed is not None
    assert torch.equal(swiglu(proj, x, INTER), silu_and_mul(proj(x), INTER))


def test_another_projection_in_its_place_takes_the_unfused_path() -> None:
    """An FP8 (or any other) linear that replaced the projection returns [T, 2I]: swiglu applies
    silu_and_mul to it."""
    proj = projection(torch.float32)
    plain = torch.nn.Linear(HIDDEN, 2 * INTER, bias=False)
    with torch.no_grad():
        plain.weight.copy_(plain_weight(proj))
    x = inputs(4, torch.float32)
    assert torch.equal(swiglu(plain, x, INTER), silu_and_mul(plain(x), INTER))
