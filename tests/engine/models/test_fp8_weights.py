"""FP8 weights: block/tensor/channel checkpoints load to the same logits as their dequantized
weights, quantizing at load matches the checkpoint writer, the tied table is stored once, and
the memory breakdown equals the loaded model's tensor bytes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from chatfleet.engine.builtin_models.fp8 import to_fp8_checkpoint
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models.fp8_format import FP8WeightFormat
from chatfleet.engine.models.fp8_linear import FP8Linear, dequantize_weight, quantize_weight
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.sizing.memory import memory_breakdown
from chatfleet.errors import ConfigError

IDS = torch.tensor([5, 900, 17, 2048, 3, 77, 1200, 8, 64, 4000, 311, 12])


def logits(loaded, ids=IDS):
    with torch.inference_mode():
        return loaded.model.compute_logits(loaded.model(ids, torch.arange(len(ids))))


def tensor_bytes(model) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def test_block_quantization_handles_partial_tiles_exactly():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    fmt = FP8WeightFormat()
    q, s = quantize_weight(w, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    expanded = s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert torch.equal(dequantize_weight(q, s, fmt, torch.float32), q.float() * expanded)
    tile_amax = w[256:, 128:].abs().max()  # the partial corner tile has its own scale
    assert s[2, 1] == pytest.approx(float(tile_amax) / 448)
    assert (dequantize_weight(q, s, fmt, torch.float32) - w).abs().max() < 0.07 * w.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_weight_rounds_like_torch_with_any_scale(dtype):
    """Placed bits times folded scales: one rounding of ``fp8 * scale`` (PyTorch's conversion),
    also where a scale of 2**8 or more cannot fold the placement's power of two in."""
    torch.manual_seed(1)
    fmt = FP8WeightFormat()
    q, s = quantize_weight(torch.randn(300, 200), fmt)
    s[0, 1], s[2, 0] = 300.0, 2.0**-30  # a huge and a tiny tile scale beside ordinary ones
    expanded = s.to(dtype).float().repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert torch.equal(dequantize_weight(q, s, fmt, dtype), (q.float() * expanded).to(dtype))
    layer = FP8Linear(200, [300], fmt, dtype=dtype)
    layer.set_part(0, q, s)
    assert torch.equal(layer.dequantized(dtype), (q.float() * expanded).to(dtype))
    layer.set_part(0, q, s * 2)  # a new scale is seen (the folded copy follows the buffer's version)
    assert torch.equal(layer.dequantized(dtype), (q.float() * expanded * 2).to(dtype))


def _dequantized_copy(fp8_folder, dst):
    """The FP8 checkpoint's weights dequantized to float32, as a plain checkpoint."""
    shutil.copytree(fp8_folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    fmt = FP8WeightFormat.from_hf(cfg)
    tensors = load_file(dst / "model.safetensors")
    plain = {}
    for name, t in tensors.items():
        if name.endswith(("weight_scale_inv", "weight_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name.removesuffix("weight") + fmt.scale_name]
            plain[name] = dequantize_weight(t, scale, fmt, torch.float32)
        else:
            plain[name] = t.float()
    save_file(plain, str(dst / "model.safetensors"), metadata={"format": "pt"})
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _variant(tmp_path, name, fp8=None, untied=False):
    """A copy of the cached tiny model: as an FP8 checkpoint in ``fp8``'s format, or untied."""
    dst = tmp_path / name
    shutil.copytree(resolve_model("tiny"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    tensors = load_file(dst / "model.safetensors")
    if untied:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] * 0.5
        cfg["tie_word_embeddings"] = False
    if fp8 is not None:
        tensors = to_fp8_checkpoint(tensors, fp8)
        cfg.update(torch_dtype="bfloat16", quantization_config=fp8.to_hf())
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("fmt", [FP8WeightFormat(), FP8WeightFormat("tensor"), FP8WeightFormat("channel")],
                         ids=["block", "tensor", "channel"])
def test_fp8_checkpoint_equals_its_dequantized_weights(tmp_path, fmt):
    fp8 = _variant(tmp_path, "fp8", fp8=fmt)
    plain = _dequantized_copy(fp8, tmp_path / "plain")
    a = load_model(fp8, kernels="torch")
    b = load_model(plain, kernels="torch")
    assert isinstance(a.model.layers[0].self_attn.qkv_proj, FP8Linear)
    assert a.model.layers[0].self_attn.qkv_proj.fmt == fmt
    torch.testing.assert_close(logits(a), logits(b), atol=2e-5, rtol=1e-5)


def test_quantizing_at_load_matches_the_fp8_checkpoint():
    at_load = load_model(resolve_model("tiny"), quantization="fp8", kernels="torch")
    checkpoint = load_model(resolve_model("tiny-fp8"), kernels="torch")
    a, b = dict(at_load.model.named_buffers()), dict(checkpoint.model.named_buffers())
    assert a.keys() == b.keys() and any(k.endswith("weight_0") for k in a)
    for k in a:
        assert torch.equal(a[k].view(torch.uint8) if a[k].dtype == torch.float8_e4m3fn else a[k],
                           b[k].view(torch.uint8) if b[k].dtype == torch.float8_e4m3fn else b[k]), k
    with pytest.raises(ConfigError, match="unknown quantization"):
        load_model(resolve_model("tiny"), quantization="int4")


def test_fp8_scales_missing_is_a_clear_error(tmp_path):
    folder = _variant(tmp_path, "m", fp8=FP8WeightFormat())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="has no scale tensor"):
        load_model(folder)


def test_tied_table_stored_once_even_if_the_folder_has_lm_head(tmp_path):
    folder = tmp_path / "tied"
    shutil.copytree(resolve_model("tiny"), folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"))
    loaded = load_model(folder, kernels="torch")
    assert loaded.model.lm_head is None
    emb = loaded.model.embed_tokens.weight
    assert sum(1 for t in [*loaded.model.parameters(), *loaded.model.buffers()] if t.shape == emb.shape) == 1


@pytest.mark.parametrize("model,options", [
    ("tiny", {}),
    ("tiny", {"quantization": "fp8", "embedding_dtype": "fp8"}),
    ("tiny", {"dtype": "bfloat16", "embedding_dtype": "fp8"}),
    ("tiny-fp8", {"dtype": "bfloat16"}),
    ("untied", {"quantization": "fp8", "embedding_dtype": "fp8"}),
    ("untied", {"dtype": "bfloat16"}),
])
def test_breakdown_equals_the_loaded_tensor_bytes(tmp_path, model, options):
    folder = _variant(tmp_path, model, untied=True) if model == "untied" else resolve_model(model)
    loaded = load_model(folder, kernels="torch", **options)
    dtype = options.get("dtype", "float32")
    b = memory_breakdown(loaded.hf_config, dtype=dtype, quantization=options.get("quantization"),
                         embedding_dtype=options.get("embedding_dtype", "auto"))
    assert b.weight_bytes == tensor_bytes(loaded.model)
    assert b.tie_word_embeddings == (model != "untied") == (loaded.model.lm_head is None)


def test_fp8_embedding_logits_and_lookup_match_dequantized_table():
    plain = load_model(resolve_model("tiny"), kernels="torch")
    fp8 = load_model(resolve_model("tiny"), embedding_dtype="fp8", kernels="torch")
    table = fp8.model.embed_tokens
    dq = table.weight.float() * table.row_scale[:, None]
    with torch.inference_mode():
        torch.testing.assert_close(table(IDS), dq[IDS])
        hidden = torch.randn(3, 128)
        torch.testing.assert_close(fp8.model.compute_logits(hidden), hidden @ dq.t(), atol=1e-5, rtol=1e-5)
    rel = (dq - plain.model.embed_tokens.weight).abs().max() / plain.model.embed_tokens.weight.abs().max()
    assert 0 < rel < 0.07
