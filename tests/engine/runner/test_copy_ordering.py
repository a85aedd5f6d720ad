"""The host tier's ordering rules, on the CPU, with a copy engine that delays every copy until
something waits on it (a stream that has not run yet): a load lands before the step reads it,
and a store leaves before its block is written again. Without those waits the data would be
stale: each test checks that too, so the ordering is what makes it pass."""

from collections.abc import Callable

import pytest
import torch

from chatfleet.engine.models.attention import KVCache
from chatfleet.engine.outputs import KVTransfer, TransferDirection
from chatfleet.engine.runner.kv_transfer import HostKVTransfer

LOAD, STORE = TransferDirection.LOAD, TransferDirection.STORE


class _Pending:
    def __init__(self, engine: "DelayedCopies", index: int) -> None:
        self.engine, self.index = engine, index

    def done(self) -> bool:
        return self.engine.ran > self.index


class DelayedCopies:
    """Copies queue up and run in order only when the compute side waits on one of them."""

    def __init__(self) -> None:
        self.queue: list[Callable[[], None]] = []
        self.ran = 0
        self.waits: list[int] = []  # the copy index each wait was for
        self.after_compute_calls = 0

    def after_compute(self) -> None:
        self.after_compute_calls += 1

    def submit(self, copy: Callable[[], None]) -> _Pending:
        self.queue.append(copy)
        return _Pending(self, len(self.queue) - 1)

    def wait(self, event: _Pending) -> None:
        self.waits.append(event.index)
        while self.ran <= event.index:
            self.queue[self.ran]()
            self.ran += 1


def _caches(seed: int = 0, layers: int = 2) -> list[KVCache]:
    torch.manual_seed(seed)
    return [KVCache(torch.randn(2, 8, 4, 3), torch.randn(2, 8, 4, 3)) for _ in range(layers)]


def test_the_step_waits_for_a_load_before_reading_it():
    caches = _caches()
    source = [(c.key[:, 3].clone(), c.value[:, 3].clone()) for c in caches]
    copies = DelayedCopies()
    tier = HostKVTransfer(caches, num_host_blocks=4, copies=copies)
    tier.execute([KVTransfer(STORE, (3,), (2,))])
    assert copies.ran == 0 and tier.stores_in_flight == 1  # the store has not left yet
    tier.execute([KVTransfer(LOAD, (6,), (2,))])
    # the load was waited on (so the store before it ran too, in stream order) ...
    assert copies.waits == [1] and copies.ran == 2 and copies.after_compute_calls == 2
    for c, (k, v) in zip(caches, source, strict=True):  # ... and the block the step reads is there
        assert torch.equal(c.key[:, 6], k) and torch.equal(c.value[:, 6], v)


def test_a_block_is_not_rewritten_before_its_store_has_left():
    caches = _caches(1)
    want = [(c.key[:, 5].clone(), c.value[:, 5].clone()) for c in caches]
    copies = DelayedCopies()
    tier = HostKVTransfer(caches, num_host_blocks=4, copies=copies)
    tier.execute([KVTransfer(STORE, (5, 1), (0, 3))])
    tier.before_write([7])  # another block: no need to wait
    assert copies.waits == [] and copies.ran == 0
    tier.before_write([5])  # the step is about to write block 5: its store must leave first
    assert copies.waits == [0] and copies.ran == 1 and tier.stores_in_flight == 0
    for c in caches:  # the new owner writes the block
        c.key[:, 5] = 0
        c.value[:, 5] = 0
    tier.execute([KVTransfer(LOAD, (2,), (0,))])
    for c, (k, v) in zip(caches, want, strict=True):  # the host copy holds what was stored
        assert torch.equal(c.key[:, 2], k) and torch.equal(c.value[:, 2], v)


def test_without_the_waits_the_data_would_be_stale():
    """The oracle for the two tests above: a delayed load that nobody waits on has not landed,
    and a delayed store whose block is overwritten first saves the new owner's data."""
    caches = _caches(2)
    copies = DelayedCopies()
    tier = HostKVTransfer(caches, num_host_blocks=2, copies=copies)
    before = caches[0].key[:, 4].clone()
    tier.copies.submit(lambda: tier._store(KVTransfer(STORE, (4,), (1,))))
    caches[0].key[:, 4] = 0  # written before the store ran
    tier.copies.wait(tier.copies.submit(lambda: tier._load(KVTransfer(LOAD, (0,), (1,)))))
    assert not torch.equal(caches[0].key[:, 0], before)
    assert torch.equal(caches[0].key[:, 0], torch.zeros_like(before))


@pytest.fixture(scope="module")
def tiny():
    from chatfleet.engine.builtin_models.tiny import resolve_model
    from chatfleet.engine.models.loader import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(resolve_model("tiny"), dtype="float32")
    torch.set_num_threads(threads)


def test_engine_reloads_from_the_host_tier_through_delayed_copies(tiny):
    """Greedy output after host-tier reloads equals a cold run when every copy is delayed until
    the runner waits on it (the engine's ordering, not the copies' speed, keeps it right)."""
    from chatfleet.engine.config import CacheConfig, EngineConfig
    from chatfleet.engine.engine import Engine
    from chatfleet.engine.request import SamplingParams
    from chatfleet.engine.runner.torch_runner import TorchRunner

    bs = 16
    tok = tiny.tokenizer
    story = "The harbour at dusk: gulls, tar, rope, lanterns and a long story about the tide. " * 3
    prompts = [tok.encode_chat([{"role": "user", "content": f"{i}: {story}"}]) for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def engine(num_blocks, host_blocks, copies=None):
        config = EngineConfig(model="tiny", max_model_len=512,
                              cache=CacheConfig(block_size=bs, num_tokens=num_blocks * bs))
        runner = TorchRunner(tiny, num_blocks, bs, num_host_blocks=host_blocks, copy_engine=copies)
        return Engine(config, runner=runner, tokenizer=tok)

    def run(e, rid, prompt):
        e.add_request(rid, prompt, params)
        out = []
        while e.has_unfinished_requests():
            out += [t for o in e.step() for t in o.new_token_ids]
            e.check_integrity()
        return out

    cold = [run(engine(64, 0), f"c{i}", p) for i, p in enumerate(prompts)]
    copies = DelayedCopies()
    e = engine(-(-(max(map(len, prompts)) + 6) // bs) + 1, 32, copies)
    first = [run(e, f"a{i}", p) for i, p in enumerate(prompts)]  # each evicts the one before
    again = [run(e, f"b{i}", p) for i, p in enumerate(prompts)]
    stats = e.stats()
    assert stats.host_demotions > 0 and stats.host_promotions > 0, stats
    assert copies.waits, "the runner never waited on a copy"
    assert first == cold and again == cold
