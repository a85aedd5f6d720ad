"""The GPU catalog: the packaged entries load, user catalogs extend and override, bad input fails clearly."""

from __future__ import annotations

import pytest

from chatfleet.errors import ConfigError
from chatfleet.plan.catalog import load_catalog, parse_catalog

REQUIRED_GPUS = ("L4", "L40S", "RTX-4090", "RTX-5090", "A100-40GB", "A100-80GB", "H100", "H200", "B200")


def test_packaged_catalog_has_the_required_gpus_with_spec_sheet_numbers():
    cat = load_catalog()
    for name in REQUIRED_GPUS:
        g = cat.get(name)
        assert g.memory_bytes > 0 and g.memory_bandwidth_gbps > 0 and g.bf16_tflops > 0 and g.pcie_gbps > 0
        assert g.source
    h100 = cat.get("h100-sxm")  # aliases, case-insensitive
    assert h100.name == "H100" and h100.memory_bytes == 80 * 10**9 and h100.memory_bandwidth_gbps == 3350
    assert h100.flops_per_s("fp8") == pytest.approx(2 * h100.flops_per_s("bf16"), rel=1e-3)
    a100 = cat.get("A100-80GB")
    assert a100.fp8_tflops is None and a100.flops_per_s("fp8") == a100.flops_per_s("bf16")  # no FP8 cores


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown GPU 'X9'.*H100"):
        load_catalog().get("X9")


def test_user_catalog_adds_and_overrides(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("gpus:\n  H100:\n    memory: 79.6GiB\n    memory_bandwidth_gbps: 3000\n    bf16_tflops: 900\n"
                 "    pcie_gbps: 50\n    efficiency: {compute: 0.5, step_overhead_ms: 3}\n"
                 "  MyCard:\n    memory: 12GB\n    memory_bandwidth_gbps: 500\n    bf16_tflops: 50\n"
                 "    pcie_gbps: 16\n")
    cat = load_catalog(f)
    h = cat.get("H100")
    assert h.memory_bandwidth_gbps == 3000
    assert h.efficiency.compute == 0.5 and h.efficiency.step_overhead_ms == 3
    assert h.p2p_gbps == 50 and h.fp8_tflops is None  # p2p defaults to PCIe
    assert cat.get("mycard").memory_bytes == 12 * 10**9
    assert cat.get("L4").bf16_tflops == 121  # the rest stays


@pytest.mark.parametrize("body, message", [
    ("gpus: 3", "top-level 'gpus:'"),
    ("gpus:\n  X: {memory: 1GB, memory_bandwidth_gbps: 1, bf16_tflops: 1}", "X.*missing field.*pcie_gbps"),
    ("gpus:\n  X: {memory: 1GB, memory_bandwidth_gbps: -5, bf16_tflops: 1, pcie_gbps: 1}",
     "memory_bandwidth_gbps must be a positive number"),
    ("gpus:\n  X: {memory: lots, memory_bandwidth_gbps: 1, bf16_tflops: 1, pcie_gbps: 1}", "memory"),
    ("gpus:\n  X: {memory: 1GB, memory_bandwidth_gbps: 1, bf16_tflops: 1, pcie_gbps: 1, hbm: 3}", "unknown field.*hbm"),
    ("gpus:\n  X: {memory: 1GB, memory_bandwidth_gbps: 1, bf16_tflops: 1, pcie_gbps: 1, efficiency: {compute: 2}}",
     "efficiency.compute"),
    ("gpus:\n  X: {memory: 1GB, memory_bandwidth_gbps: 1, bf16_tflops: 1, pcie_gbps: 1}\n"
     "  Y: {memory: 1GB, memory_bandwidth_gbps: 1, bf16_tflops: 1, pcie_gbps: 1, aliases: [x]}", "already used"),
    ("gpus: [unclosed", "not valid YAML"),
])
def test_invalid_catalogs_fail_naming_the_problem(body, message):
    with pytest.raises(ConfigError, match=message):
        parse_catalog(body, "test.yaml")


def test_missing_user_catalog_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_catalog(tmp_path / "nope.yaml")
