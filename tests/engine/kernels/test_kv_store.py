"""KV store: the Triton kernel (interpreted) writes what ``KVCache.write`` writes, skips padding
slots, and quantizes exactly as the FP8 cache does."""

import pytest
import torch
from kernel_env import fp8_grid_values, needs_interpreter

from chatfleet.engine.kernels.kv_store import store_kv, store_kv_reference
from chatfleet.engine.models.kv_cache import FP8

SLOTS = [3, 17, -1, 40, 79, 0, 33]  # scattered, one padding row


def rows(dtype: torch.dtype, head_dim: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (len(SLOTS), 2, head_dim)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [24, 32])
def test_triton_store_matches_cache_write(dtype, head_dim):
    k, v = rows(dtype, head_dim)
    slots = torch.tensor(SLOTS)
    got = [torch.full((2, 5, 16, head_dim), 7.0, dtype=dtype) for _ in range(2)]
    want = [t.clone() for t in got]
    store_kv(k, v, *got, slots, backend="triton")
    store_kv_reference(k, v, *want, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (got[0] == 7.0).sum() == (5 * 16 - 6) * 2 * head_dim  # nothing else written


@needs_interpreter
def test_triton_quantization_matches_fp8_cache():
    """Values on the e4m3 grid (times the scale) plus clamped and subnormal-range ones: stored
    unrounded into float32 by the kernel's quantize step, they equal the FP8 cache's codes."""
    from chatfleet.engine.kernels.kv_store_triton import store_kv_triton

    g = torch.Generator().manual_seed(1)
    scale = 0.25
    k = fp8_grid_values(len(SLOTS) * 2 * 24, g).view(len(SLOTS), 2, 24) * scale
    k[0, 0, :5] = torch.tensor([2**-8, 2**-7, -(2**-7) * 1.5, 1000.0, -1000.0]) * scale
    v = k.flip(0)
    slots = torch.tensor(SLOTS)
    got = [torch.zeros(2, 5, 16, 24) for _ in range(2)]
    store_kv_triton(k, v, *got, slots, scale, scale, quantize=True)
    want = [torch.zeros(2, 5, 16, 24, dtype=FP8) for _ in range(2)]
    store_kv_reference(k, v, *want, slots, scale, scale)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.to(FP8).view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(a, b.float())  # already on the grid: the store's rounding is exact


def test_auto_on_cpu_is_the_reference_and_drops_padding():
    k, v = rows(torch.float32)
    got = [torch.zeros(2, 5, 16, 24) for _ in range(2)]
    store_kv(k, v, *got, torch.tensor(SLOTS))
    flat = got[0].view(2, -1, 24)
    assert torch.equal(flat[:, 79], k[4]) and torch.equal(flat[:, 3], k[0])
