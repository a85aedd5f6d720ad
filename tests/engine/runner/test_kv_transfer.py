"""KV transfers on tensors: a store then a load moves whole blocks of every layer, K and V."""

import torch

from chatfleet.engine.models.attention import KVCache
from chatfleet.engine.outputs import KVTransfer, TransferDirection
from chatfleet.engine.runner.kv_transfer import HostKVTransfer


def test_store_then_load_round_trips_every_layer():
    torch.manual_seed(0)
    caches = [KVCache(torch.randn(2, 8, 4, 3), torch.randn(2, 8, 4, 3)) for _ in range(3)]
    before = [(c.key.clone(), c.value.clone()) for c in caches]
    tier = HostKVTransfer(caches, num_host_blocks=4)
    stats = tier.execute([KVTransfer(TransferDirection.STORE, (1, 6), (3, 0))])
    assert stats.blocks_stored == 2 and stats.bytes_stored == 2 * tier.bytes_per_block
    for c in caches:  # the device blocks get new owners
        c.key[:, [1, 6]] = 0
        c.value[:, [1, 6]] = 0
    # a load listed first still runs after the store of the same plan
    plan = [KVTransfer(TransferDirection.LOAD, (2, 5), (3, 1)), KVTransfer(TransferDirection.STORE, (7,), (1,))]
    stats = tier.execute(plan)
    assert stats.blocks_loaded == 2 and stats.blocks_stored == 1
    for c, (k, v) in zip(caches, before, strict=True):
        assert torch.equal(c.key[:, 2], k[:, 1]) and torch.equal(c.value[:, 2], v[:, 1])
        assert torch.equal(c.key[:, 5], k[:, 7]) and torch.equal(c.value[:, 5], v[:, 7])
        assert torch.equal(c.key[:, 0], k[:, 0])  # untouched blocks stay


def test_fp8_cache_blocks_move_as_bytes():
    from chatfleet.engine.models.kv_cache import FP8

    torch.manual_seed(1)
    caches = [KVCache(torch.randn(2, 6, 4, 3).to(FP8), torch.randn(2, 6, 4, 3).to(FP8), 0.5, 0.25)]
    want_k, want_v = caches[0].key[:, 4].float().clone(), caches[0].value[:, 4].float().clone()
    tier = HostKVTransfer(caches, num_host_blocks=2)
    assert tier.bytes_per_block == 2 * 2 * 4 * 3  # one byte per element
    tier.execute([KVTransfer(TransferDirection.STORE, (4,), (1,))])
    tier.execute([KVTransfer(TransferDirection.LOAD, (0,), (1,))])
    assert caches[0].key.dtype == FP8
    assert torch.equal(caches[0].key[:, 0].float(), want_k) and torch.equal(caches[0].value[:, 0].float(), want_v)
