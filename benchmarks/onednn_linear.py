"""Experiment: our model with every nn.Linear run through oneDNN on prepacked weights.

vLLM's CPU build runs its linear layers this way; PyTorch's default F.linear goes to MKL's
sgemm, which is 2-3x slower on this machine's AMD CPU at batch sizes of 8 and more. Used by
forward_breakdown.py and, as the opt-in backend `ours_onednn`, by engine_throughput.py, to
measure what the swap is worth before it is made in src/. Run as a script it is
`chatfleet engine ...` with the swap applied at model load.
"""

from __future__ import annotations

import sys

import torch


class OneDNNLinear(torch.nn.Module):
    """nn.Linear through oneDNN with the weight prepacked once."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def use_onednn(model: torch.nn.Module) -> None:
    """Swap every nn.Linear of `model` (and its untied lm_head's logits) for OneDNNLinear."""
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(mod, child_name, OneDNNLinear(child))
    head = getattr(model, "lm_head", None)
    if head is not None:
        model.compute_logits = lambda h: head(h).float()  # type: ignore[method-assign]


def main() -> None:
    import chatfleet.engine.models.loader as loader

    original = loader.load_model

    def load_model(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        loaded = original(*args, **kwargs)
        use_onednn(loaded.model)
        return loaded

    loader.load_model = load_model  # the engine imports it from the loader at start
    from chatfleet.cli.main import app

    sys.argv = ["chatfleet", *sys.argv[1:]]
    app()


if __name__ == "__main__":
    main()
