"""Gemma 4 quantized to FP8 at load: every linear (experts included) FP8, bytes as the breakdown says."""

from __future__ import annotations

import json

import torch

from chatfleet.engine.builtin_models.tiny_gemma4 import build_named
from chatfleet.engine.models.fp8_linear import FP8Linear
from chatfleet.engine.models.linear import Linear
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.sizing.memory import memory_breakdown


def test_fp8_at_load_covers_experts_and_matches_the_breakdown(tmp_path):
    folder = build_named("tiny-gemma4-moe", tmp_path / "m")
    plain = load_model(folder, kernels="torch")
    fp8 = load_model(folder, kernels="torch", quantization="fp8")
    model = fp8.model
    experts = [m for n, m in model.named_modules() if ".experts.experts." in n and isinstance(m, FP8Linear)]
    cfg = fp8.config
    assert len(experts) == 2 * cfg.num_experts * cfg.num_layers
    assert not any(isinstance(m, Linear) for m in model.modules())  # tied lm_head is the embedding
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    hf = json.loads((folder / "config.json").read_text())
    assert memory_breakdown(hf, dtype="float32", quantization="fp8").weight_bytes == held
    # The FP8 model equals the float model holding the dequantized weights (routing included).
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, FP8Linear):
                plain.model.get_submodule(name).weight.copy_(m.dequantized(torch.float32))
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = plain.model.compute_logits(plain.model(ids, torch.arange(40)))
        got = model.compute_logits(model(ids, torch.arange(40)))
    assert (got - want).abs().max().item() <= 1e-4
