"""The engine's memory stays flat while oneDNN sees ever new matrix shapes (chat prefills)."""

from __future__ import annotations

import os
import subprocess
import sys

from chatfleet.native_caches import CACHE_VARIABLES, bound_native_caches

# Run in a fresh interpreter: the caps are read when torch loads. Prefill attention products of
# ever new context lengths, as a serving engine sees them; RSS after the caches could have
# filled (300 shapes: 600 kernels, more than the bound) and after 500 more shapes.
PROBE = """
import chatfleet, torch
from chatfleet.engine.models.linear import onednn_available, onednn_matmul_nt
assert onednn_available(torch.device("cpu"), torch.float32)
torch.set_num_threads(1)
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))
q = torch.randn(256, 64)
for length in range(1, 801):
    onednn_matmul_nt(q, torch.randn(length, 64))
    onednn_matmul_nt(torch.randn(256, length), torch.randn(64, length))
    if length == 300:
        filled = rss_mb()
print(rss_mb() - filled)
"""


def rss_growth_mb(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


def test_bound_native_caches_keeps_a_value_already_set():
    env = {"LRU_CACHE_CAPACITY": "8"}
    bound_native_caches(env)
    assert env["LRU_CACHE_CAPACITY"] == "8"
    assert all(env[name].isdigit() for name in CACHE_VARIABLES)


def test_memory_stays_flat_as_kernel_shapes_keep_changing():
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    growth = rss_growth_mb(env)
    # bounded: ~30 MB (allocator noise); unbounded (the libraries' default, 1,024 entries each): ~440 MB
    assert growth < 100, f"RSS grew {growth:.0f} MB over 500 new shapes with the caches bounded"
