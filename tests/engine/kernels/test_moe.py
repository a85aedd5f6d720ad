"""MoE kernels: the router's top-k softmax and the grouped expert GEMM (interpreted) against
their references, and the references against the engine's ``Router`` and ``Experts``."""

import pytest
import torch
import torch.nn.functional as F
from kernel_env import needs_interpreter

from chatfleet.engine.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from chatfleet.engine.kernels.moe_experts import StackedExperts, expert_mlp
from chatfleet.engine.kernels.moe_router import topk_softmax, topk_softmax_reference
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import quantize_weight
from chatfleet.engine.models.moe import Experts, Router


def router_and_experts(hidden: int = 32, inter: int = 24, num_experts: int = 6, top_k: int = 2):
    torch.manual_seed(0)
    router, experts = Router(hidden, num_experts, top_k, 1e-6), Experts(hidden, inter, num_experts)
    with torch.no_grad():
        for p in list(router.parameters()) + list(experts.parameters()):
            p.normal_(0.0, 0.3)
    return router, experts


@needs_interpreter
@pytest.mark.parametrize("tokens,num_experts,top_k", [(5, 8, 2), (9, 128, 8), (3, 6, 6), (4, 20, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_scale", [False, True])
def test_triton_topk_softmax_matches_reference(tokens, num_experts, top_k, dtype, with_scale):
    g = torch.Generator().manual_seed(tokens)
    logits = (torch.randn(tokens, num_experts, generator=g) * 2).to(dtype)
    scale = torch.rand(num_experts, generator=g) + 0.5 if with_scale else None
    got = topk_softmax(logits, top_k, scale, backend="triton")
    want = topk_softmax_reference(logits, top_k, scale)
    assert torch.equal(got.experts, want.experts)
    torch.testing.assert_close(got.weights, want.weights, atol=1e-6, rtol=1e-6)


def test_topk_reference_is_the_routers():
    router, _ = router_and_experts()
    x = torch.randn(7, 32)
    with torch.no_grad():
        want = router(x)
        h = F.rms_norm(x, (32,), None, router.eps) * router.scale * router.root_size
        got = topk_softmax(router.proj(h), router.top_k, router.per_expert_scale)
    assert torch.equal(got.experts, want.experts)
    torch.testing.assert_close(got.weights, want.weights)


def expert_case(dtype: torch.dtype, block: tuple[int, int] | None, seed: int = 0):
    """Three of five experts busy (two get no rows), N and K not multiples of the tiles."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(5, 40, 48, generator=g)
    offsets = torch.tensor([0, 3, 3, 19, 20, 20], dtype=torch.int32)
    x = torch.randn(20, 48, generator=g).to(dtype)
    if block is None:
        return x, offsets, weight.to(dtype), None, None
    parts = [quantize_weight(w, FP8WeightFormat("block", block)) for w in weight]
    return x, offsets, torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]), block


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("block", [None, (16, 16), (32, 16)])
def test_triton_grouped_gemm_matches_reference(dtype, tol, block):
    x, offsets, weight, scale, blk = expert_case(dtype, block)
    kernel_weight = weight.to(dtype) if scale is not None else weight  # e4m3 values, exactly, for the interpreter
    got = grouped_gemm(x, offsets, kernel_weight, scale, blk, backend="triton")
    want = grouped_gemm_reference(x, offsets, weight, scale, blk)
    s = want.float().abs().max()
    torch.testing.assert_close(got.float() / s, want.float() / s, atol=tol, rtol=0)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_expert_mlp_equals_engine_experts(backend):
    router, experts = router_and_experts()
    x = torch.randn(9, 32)
    stacked = StackedExperts(torch.stack([e.gate_up_proj.weight.detach() for e in experts.experts]),
                             torch.stack([e.down_proj.weight.detach() for e in experts.experts]))
    with torch.no_grad():
        choice = router(x)
        torch.testing.assert_close(expert_mlp(x, choice, stacked, backend), experts(x, choice), atol=1e-5, rtol=1e-5)
