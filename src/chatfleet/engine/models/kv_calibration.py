"""Measure FP8 KV scales from prompt tokens: ``amax / 448`` of each layer's keys and values.

``measure_kv_scales(model, prompts, limit, device)`` runs the model once, without a cache, over up to
``limit`` tokens of the given prompts (each as its own causal sequence from position 0) and
records the largest absolute key and value of every layer (after the k norm and RoPE: exactly
what the cache stores). The runner calls it on the first step's fresh prompts, before anything
is written to an FP8 cache, and freezes the result.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from chatfleet.engine.models.kv_scales import KVScales
from chatfleet.engine.models.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)


def measure_kv_scales(model: Qwen3ForCausalLM, prompts: Sequence[Sequence[int]], limit: int,
                      device: torch.device) -> KVScales:
    """Scales from at most ``limit`` tokens of ``prompts`` (taken in order)."""
    num_layers = len(model.layers)
    k_amax = [0.0] * num_layers
    v_amax = [0.0] * num_layers

    def observer(i: int):
        def observe(k: torch.Tensor, v: torch.Tensor) -> None:
            k_amax[i] = max(k_amax[i], float(k.abs().max()))
            v_amax[i] = max(v_amax[i], float(v.abs().max()))
        return observe

    left = limit
    for i, layer in enumerate(model.decoder_layers):
        layer.self_attn.kv_observer = observer(i)
    try:
        with torch.inference_mode():
            for tokens in prompts:
                if left <= 0:
                    break
                ids = list(tokens[:left])
                left -= len(ids)
                if ids:
                    model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device))
    finally:
        for layer in model.decoder_layers:
            layer.self_attn.kv_observer = None
    unseen = [i for i, a in enumerate(k_amax) if a == 0.0]
    if unseen and left < limit:
        log.warning("FP8 KV cache: layers %s showed no keys while measuring scales (their attention"
                    " reports none, or they reuse another layer's KV); their scales stay 1.0", unseen)
    return KVScales.from_amax(k_amax, v_amax)
