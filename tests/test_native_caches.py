"""The engine's memory stays flat while oneDNN sees ever new matrix shapes (chat prefills)."""

from __future__ import annotations

import os
import subprocess
import sys

from chatfleet.native_caches import BOUND_MARK, CACHE_ENTRIES, CACHE_VARIABLES, bound_native_caches, widen_native_cache

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


def test_widen_raises_only_what_chatfleet_set_in_this_or_a_parent_process():
    env = {"LRU_CACHE_CAPACITY": "8"}
    bound_native_caches(env)
    assert not widen_native_cache("LRU_CACHE_CAPACITY", 4096, env)  # the user's
    assert env["LRU_CACHE_CAPACITY"] == "8"
    assert widen_native_cache("ONEDNN_PRIMITIVE_CACHE_CAPACITY", 4096, env)  # chatfleet's
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "4096"
    child = dict(env)  # a process started with this environment, importing chatfleet again
    bound_native_caches(child)
    assert widen_native_cache("ONEDNN_PRIMITIVE_CACHE_CAPACITY", 8192, child)
    assert child["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "8192"
    assert widen_native_cache("ONEDNN_PRIMITIVE_CACHE_CAPACITY", 16, child)  # never lowered
    assert child["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "8192"
    fresh = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(CACHE_ENTRIES)}  # the user's, equal to the default
    bound_native_caches(fresh)
    assert BOUND_MARK in fresh and not widen_native_cache("ONEDNN_PRIMITIVE_CACHE_CAPACITY", 4096, fresh)


def test_memory_stays_flat_as_kernel_shapes_keep_changing():
    env = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    growth = rss_growth_mb(env)
    # bounded: ~3-30 MB (allocator noise), once 107 MB inside a full suite run on an AMX Xeon;
    # unbounded (the libraries' default, 1,024 entries each): 420-440 MB
    assert growth < 200, f"RSS grew {growth:.0f} MB over 500 new shapes with the caches bounded"
