"""The host tier's one-pass block copy against its torch ops: the same bytes on both sides after
every store and load, in every dtype the caches take (FP8 as raw bytes)."""

import random

import pytest
import torch

from chatfleet.engine.models.attention import KVCache
from chatfleet.engine.models.kv_cache import FP8
from chatfleet.engine.outputs import KVTransfer, TransferDirection
from chatfleet.engine.runner import block_copy
from chatfleet.engine.runner.block_copy import BlockCopier
from chatfleet.engine.runner.kv_transfer import HostKVTransfer

needs_kernel = pytest.mark.skipif(not block_copy.available(), reason="block copy kernel not built here")


def _caches(dtype: torch.dtype, layers: int = 3, heads: int = 2, blocks: int = 12, block: int = 4,
            dim: int = 8) -> list[KVCache]:
    def t() -> torch.Tensor:
        return torch.randn(heads, blocks, block, dim).to(dtype)
    return [KVCache(t(), t()) for _ in range(layers)]


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
def test_kernel_moves_the_bytes_torch_moves(dtype):
    torch.manual_seed(0)
    rng = random.Random(0)
    ours = _caches(dtype)
    theirs = [KVCache(c.key.clone(), c.value.clone()) for c in ours]
    fast, slow = HostKVTransfer(ours, num_host_blocks=9), HostKVTransfer(theirs, num_host_blocks=9)
    assert fast._copier is not None
    slow._copier = None  # the torch ops
    for _ in range(30):
        n = rng.randint(1, 5)
        device = rng.sample(range(12), n)
        host = rng.sample(range(9), n)
        direction = rng.choice((TransferDirection.STORE, TransferDirection.LOAD))
        plan = [KVTransfer(direction, tuple(device), tuple(host))]
        got, want = fast.execute(plan), slow.execute(plan)
        assert (got.blocks_stored, got.blocks_loaded, got.bytes_stored, got.bytes_loaded) == \
            (want.blocks_stored, want.blocks_loaded, want.bytes_stored, want.bytes_loaded)
        assert torch.equal(fast.host.view(torch.uint8), slow.host.view(torch.uint8))
        for mine, ref in zip(ours, theirs, strict=True):
            assert torch.equal(mine.key.view(torch.uint8), ref.key.view(torch.uint8))
            assert torch.equal(mine.value.view(torch.uint8), ref.value.view(torch.uint8))


@needs_kernel
def test_layouts_the_kernel_does_not_read_keep_the_torch_ops():
    host = torch.zeros(4, 2, 2, 4, 8)
    key = torch.zeros(2, 6, 4, 8)
    assert BlockCopier.for_tensors(host, [key, key.clone()]) is not None
    strided = torch.zeros(2, 6, 8, 4).transpose(2, 3)  # [heads, blocks, block, dim], dim not contiguous
    assert BlockCopier.for_tensors(host, [key, strided]) is None
    assert BlockCopier.for_tensors(host, [key]) is None  # the host holds two tensors a block
    assert BlockCopier.for_tensors(host, [key[0], key[1]]) is None  # not [heads, blocks, block, dim]
    assert BlockCopier.for_tensors(host, [key, key.double()]) is None  # another element size


@needs_kernel
def test_block_ids_outside_either_side_are_refused():
    caches = _caches(torch.float32, layers=1, blocks=5)
    tier = HostKVTransfer(caches, num_host_blocks=3)
    assert tier._copier is not None
    with pytest.raises(IndexError):
        tier.execute([KVTransfer(TransferDirection.STORE, (5,), (0,))])
    with pytest.raises(IndexError):
        tier.execute([KVTransfer(TransferDirection.LOAD, (0,), (3,))])
    with pytest.raises(IndexError):
        tier.execute([KVTransfer(TransferDirection.LOAD, (-1,), (0,))])
