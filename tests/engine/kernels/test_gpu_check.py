"""benchmarks/gpu_check.py's dry run: the driver's every row runs (CPU, tiny shape), writes its
JSON, and the engine's GPU path gives the gather path's logits (through the references on CPU)."""

import importlib.util
import json
import sys
from pathlib import Path

import torch

from chatfleet.engine.models import qwen3
from chatfleet.engine.models.fp8_linear import FP8Linear

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.py"


def load_driver():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def test_dry_run_measures_every_row(tmp_path, capsys):
    attention, fp8_forward = qwen3.paged_attention, FP8Linear.forward
    driver = load_driver()
    out = tmp_path / "gpu_check.json"
    assert driver.main(["--dry-run", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert qwen3.paged_attention is attention and FP8Linear.forward is fp8_forward  # nothing swapped
    plan = driver.Plan.dry()
    assert len(report["decode"]) == 2 * len(plan.batches) * 4 and report["bandwidth_gbps"] > 0
    for row in report["decode"]:
        assert row["floor_ms"] > 0
        if row["graphs"]:
            assert row["error"] == "skipped: no CUDA device"
        else:
            assert row["error"] is None and row["step_ms"] > 0 and row["ratio"] > 0
    assert [p["path"] for p in report["prefill"]] == ["gather", "engine"] * 2
    assert {r["path"] for r in report["decode"]} == {"gather", "engine"} and report["card"] is None
    assert all(p["tokens_per_s"] > 0 for p in report["prefill"])
    for a in report["agreement"]:
        assert "error" not in a and a["max_abs_diff_over_max"] < 1e-2 and a["argmax_agree"] == 1.0
    assert len(report["micro"]) == 8 + 4
    assert all("error" not in m and m["dispatch_us"] > 0 and m["floor_us"] > 0 for m in report["micro"])
    assert "x floor" in capsys.readouterr().out


def test_the_card_is_named_as_the_catalog_names_it():
    driver = load_driver()
    assert driver.catalog_card("NVIDIA H200") == "H200"
    assert driver.catalog_card("NVIDIA H100 80GB HBM3") == "H100"
    assert driver.catalog_card("NVIDIA GeForce RTX 5090") == "RTX-5090"
    assert driver.catalog_card("NVIDIA A100-SXM4-80GB") in ("A100-80GB", "A100-40GB")
    assert driver.catalog_card("Some Accelerator 9000") is None


def test_floor_counts_weights_and_kv():
    driver = load_driver()
    cfg = driver.TINY
    model = driver.build_model(cfg, "bf16", torch.device("cpu"), torch.bfloat16)
    one = driver.bytes_read_per_step(model, cfg, 1, 64, 2)
    two = driver.bytes_read_per_step(model, cfg, 2, 64, 2)
    kv_per_seq = 64 * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    assert two - one == kv_per_seq + cfg.hidden_size * 2  # one more sequence's KV and embedding row
    weights = sum(p.numel() * 2 for n, p in model.named_parameters() if not n.startswith("embed_tokens"))
    assert one == weights + cfg.hidden_size * 2 + kv_per_seq
