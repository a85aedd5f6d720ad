"""The MoE router's top-k softmax: router logits -> each token's experts and weights.

``topk_softmax(logits, top_k, per_expert_scale)``: logits [T, E] (any float dtype); softmax in
float32 over all experts, the ``top_k`` largest (in descending order), renormalised to sum 1,
then times ``per_expert_scale[expert]`` (Gemma 4's learned scale; None: 1). Returns a
``RouterChoice`` (experts [T, k] long, weights [T, k] float32).

Reference: the same steps as ``moe.Router.forward`` after its projection (a test holds the two
equal, so they cannot drift apart).
"""

from __future__ import annotations

import torch

from chatfleet.engine.kernels.backend import interpreting, resolve_backend
from chatfleet.engine.models.moe import RouterChoice

MAX_EXPERTS = 1024  # one program holds a token's whole row of logits


def topk_softmax_reference(logits: torch.Tensor, top_k: int,
                           per_expert_scale: torch.Tensor | None = None) -> RouterChoice:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    if per_expert_scale is not None:
        weights = weights * per_expert_scale[experts]
    return RouterChoice(experts, weights)


def unsupported_reason(logits: torch.Tensor, top_k: int) -> str | None:
    if logits.dim() != 2 or not 1 <= top_k <= logits.shape[1]:
        return "logits must be [T, E] with 1 <= top_k <= E"
    if logits.shape[1] > MAX_EXPERTS:
        return f"{logits.shape[1]} experts (at most {MAX_EXPERTS})"
    if logits.stride(1) != 1:
        return "expert logits are not contiguous"
    if not logits.is_cuda and interpreting() and logits.dtype == torch.bfloat16:
        return "the Triton interpreter has no bfloat16 arithmetic"
    return None


def topk_softmax(logits: torch.Tensor, top_k: int, per_expert_scale: torch.Tensor | None = None,
                 backend: str = "auto") -> RouterChoice:
    """Each token's ``top_k`` experts and weights (see the module doc)."""
    tensors = (logits,) if per_expert_scale is None else (logits, per_expert_scale)
    if resolve_backend(backend, tensors, unsupported_reason(logits, top_k)) == "torch":
        return topk_softmax_reference(logits, top_k, per_expert_scale)
    from chatfleet.engine.kernels.moe_router_triton import topk_softmax_triton

    return topk_softmax_triton(logits, top_k, per_expert_scale)
