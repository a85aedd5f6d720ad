"""AsyncEngine against a small fake engine (the real engine is covered by the server tests)."""

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.output_streams import RequestFailedError
from chatfleet.engine.outputs import RequestOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.errors import EngineDeadError, InvalidRequestError, ServerOverloadedError


@dataclass
class FakeStats:
    num_running: int


class FakeEngine:
    """One token per request per step; token = step count. Only the engine thread may call it."""

    model_name = "fake"
    max_model_len = 64
    tokenizer = None

    def __init__(self, capacity=8, fail_at_step=None, error_request=None):
        self.capacity = capacity
        self.fail_at_step = fail_at_step
        self.error_request = error_request
        self.running: dict[str, list] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.integrity_checks = 0
        self.thread_names: set[str] = set()

    def _touch(self):
        self.thread_names.add(threading.current_thread().name)

    def add_request(self, request_id, prompt_token_ids, params, *, arrival_time=None, cache_salt=None,
                    session_id=None):
        self._touch()
        if not prompt_token_ids:
            raise InvalidRequestError("empty prompt")
        if len(self.running) >= self.capacity:
            raise ServerOverloadedError("queue full")
        self.running[request_id] = [params.max_tokens, 0]

    def abort_request(self, request_id):
        self._touch()
        if self.running.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        self._touch()
        self.steps += 1
        if self.fail_at_step == self.steps:
            raise RuntimeError("kernel exploded")
        time.sleep(0.002)
        outs = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            error = rid == self.error_request
            if done or error:
                del self.running[rid]
            outs.append(RequestOutput(
                request_id=rid, new_token_ids=[self.steps], new_text=f"<{self.steps}>",
                finished=done or error, finish_reason="error" if error else ("length" if done else None),
                num_prompt_tokens=1, num_cached_tokens=0, num_output_tokens=state[1],
            ))
        return outs

    def stats(self):
        return FakeStats(num_running=len(self.running))

    def reset_prefix_cache(self):
        return True

    def check_integrity(self):
        self.integrity_checks += 1


def run(coro_fn, engine, **kw):
    async def main():
        ae = AsyncEngine(engine, **kw)
        ae.start()
        try:
            return await asyncio.wait_for(coro_fn(ae), timeout=20)
        finally:
            ae.shutdown()

    return asyncio.run(main())


async def collect(ae, rid, n, prompt=(1, 2)):
    return [o async for o in ae.generate(rid, list(prompt), SamplingParams(max_tokens=n))]


def test_streams_until_finished_and_runs_on_engine_thread():
    eng = FakeEngine()

    async def body(ae):
        outs = await collect(ae, "a", 5)
        assert await ae.stats() == FakeStats(0)
        return outs

    outs = run(body, eng)
    assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert not any(o.finished for o in outs[:-1])
    assert eng.thread_names == {"chatfleet-engine"}


def test_concurrent_requests_share_steps():
    eng = FakeEngine()

    async def body(ae):
        return await asyncio.gather(*(collect(ae, f"r{i}", 3 + i) for i in range(6)))

    results = run(body, eng)
    assert [len(r) for r in results] == [3 + i for i in range(6)]
    assert eng.steps < sum(3 + i for i in range(6))  # batched, not one by one


def test_add_errors_surface_before_first_output():
    eng = FakeEngine(capacity=1)

    async def body(ae):
        with pytest.raises(InvalidRequestError):
            await collect(ae, "e", 2, prompt=())
        gen = ae.generate("long", [1], SamplingParams(max_tokens=50))
        first = await gen.__anext__()
        with pytest.raises(ServerOverloadedError):
            await collect(ae, "x", 2)
        with pytest.raises(InvalidRequestError):  # duplicate id while in flight
            await collect(ae, "long", 2)
        await gen.aclose()
        for _ in range(200):
            if await ae.call(lambda e: not e.running):
                break
            await asyncio.sleep(0.01)
        return first

    assert run(body, eng).num_output_tokens == 1
    assert eng.aborted == ["long"]


def test_consumer_stopping_early_aborts_request():
    eng = FakeEngine()

    async def body(ae):
        async for out in ae.generate("a", [1], SamplingParams(max_tokens=1000)):
            if out.num_output_tokens == 3:
                break
        for _ in range(200):
            if await ae.call(lambda e: not e.running):
                return True
            await asyncio.sleep(0.01)
        return False

    assert run(body, eng)
    assert eng.aborted == ["a"]


def test_cancelled_consumer_task_aborts_request():
    eng = FakeEngine()

    async def body(ae):
        started = asyncio.Event()

        async def consume():
            async for _ in ae.generate("c", [1], SamplingParams(max_tokens=1000)):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if await ae.call(lambda e: not e.running):
                return ae.num_streams
            await asyncio.sleep(0.01)

    assert run(body, eng) == 0
    assert eng.aborted == ["c"]


def test_request_error_fails_only_that_request():
    eng = FakeEngine(error_request="bad")

    async def body(ae):
        good = asyncio.create_task(collect(ae, "good", 4))
        with pytest.raises(RequestFailedError):
            await collect(ae, "bad", 4)
        return await good, ae.is_alive

    outs, alive = run(body, eng)
    assert len(outs) == 4 and alive


def test_step_crash_marks_engine_dead_and_fails_requests():
    eng = FakeEngine(fail_at_step=3)

    async def body(ae):
        with pytest.raises(EngineDeadError):
            await collect(ae, "a", 10)
        assert not ae.is_alive
        with pytest.raises(EngineDeadError):
            await collect(ae, "b", 1)
        with pytest.raises(EngineDeadError):
            await ae.stats()
        return True

    assert run(body, eng)


def test_integrity_checked_when_idle_and_threadsafe_call():
    eng = FakeEngine()

    async def body(ae):
        await collect(ae, "a", 3)
        fut = ae.call_threadsafe(lambda e: e.integrity_checks)
        for _ in range(100):
            if eng.integrity_checks:
                break
            await asyncio.sleep(0.01)
        await asyncio.wrap_future(fut)
        return await ae.reset_prefix_cache()

    assert run(body, eng, check_integrity_when_idle=True) is True
    assert eng.integrity_checks >= 1


def test_queue_time_observed_once_per_request_from_the_real_engine():
    """The observer hears each request's queue time once, from its first output (a value on
    ``RequestOutput``: the async engine holds no ``Request``), as the engine's clock measured it."""
    from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from chatfleet.engine.engine import Engine
    from chatfleet.engine.runner.sim_runner import SimRunner, make_byte_tokenizer

    now = [0.0]

    def clock():
        now[0] += 1.0  # every read of the engine's clock is a second later
        return now[0]

    config = EngineConfig(model="sim", max_model_len=64, cache=CacheConfig(block_size=4, num_tokens=64),
                          scheduler=SchedulerConfig(max_running=1))
    engine = Engine(config, runner=SimRunner(16, 4, vocab_size=300), tokenizer=make_byte_tokenizer(), clock=clock)
    seen: list[float] = []

    async def body(ae):
        ae.on_first_scheduled = seen.append
        outs = await asyncio.gather(collect(ae, "a", 3), collect(ae, "b", 3))
        return [o.queue_time for stream in outs for o in stream]

    queue_times = run(body, engine)
    assert len(seen) == 2 and all(t > 0 for t in seen)
    assert sorted(t for t in queue_times if t is not None) == sorted(seen)
