"""MoE blocks of a loaded model through the grouped expert path (the runner's GPU path; the torch
reference here): the same output as each block's own loop, one copy of the weights (every
expert's weights are views of the stacks), and back to the loop when taken away."""

import pytest
import torch

from chatfleet.engine.kernels.moe_experts import use_grouped_experts
from chatfleet.engine.models.moe import Experts


@pytest.fixture(scope="module", params=[None, "fp8"])
def moe_model(request):
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model

    # kernels="torch": plain weights (oneDNN-packed ones are not stacked; a GPU never packs)
    return load_model(resolve_model("tiny-gemma4-moe"), dtype="float32", kernels="torch", quantization=request.param)


def moe_model_is_fp8(proj):
    return hasattr(proj, "part_sizes")


def _blocks(loaded):
    return [m for m in loaded.model.modules() if isinstance(m, Experts)]


def test_grouped_experts_match_the_loop_and_hold_one_copy(moe_model):
    blocks = _blocks(moe_model)
    assert blocks
    torch.manual_seed(0)
    layer = next(m for m in moe_model.model.modules() if hasattr(m, "router") and hasattr(m, "experts"))
    x = torch.randn(11, blocks[0].experts[0].gate_up_proj.in_features)
    with torch.no_grad():
        choice = layer.router(x)
        want = layer.experts(x, choice)
        assert use_grouped_experts(moe_model.model, "torch") == len(blocks)
        got = layer.experts(x, choice)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    stacked = layer.experts.grouped.keywords["experts"]
    for e, mlp in enumerate(layer.experts.experts):  # each expert's own tensors are rows of the stacks
        for proj, stack in ((mlp.gate_up_proj, stacked.gate_up), (mlp.down_proj, stacked.down)):
            own = proj.weight_0 if moe_model_is_fp8(proj) else proj.weight
            assert torch.equal(own.view(torch.uint8), stack[e].view(torch.uint8))
            assert own.untyped_storage().data_ptr() == stack.untyped_storage().data_ptr()
    use_grouped_experts(moe_model.model, None)
    assert all(b.grouped is None for b in blocks)
    with torch.no_grad():
        torch.testing.assert_close(layer.experts(x, choice), want)


def test_the_kernels_path_runner_groups_the_experts(moe_model):
    from chatfleet.engine.runner.torch_runner import TorchRunner

    blocks = {"full": 8, "sliding": 8}
    TorchRunner(moe_model, blocks, 16, attention="kernels")
    assert all(b.grouped is not None for b in _blocks(moe_model))
    TorchRunner(moe_model, blocks, 16, attention="gather")
    assert all(b.grouped is None for b in _blocks(moe_model))
