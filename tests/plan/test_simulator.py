"""The simulator runs the engine's own scheduling: same plans as the plain engine loop, in
virtual time; the cost model's roofline; a simulated sweep writes the measured sweep's format."""

from __future__ import annotations

import asyncio
import random
import select
import threading

import pytest

from chatfleet.bench.loops import LoadSpec
from chatfleet.bench.records import RequestRecord
from chatfleet.bench.report import load_result, result_document, sweep_to_dict, write_json
from chatfleet.bench.slo import parse_slo
from chatfleet.bench.tokens import EstimateCounter
from chatfleet.bench.workload import Workload, get_profile
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.outputs import ScheduledChunk, SchedulerOutput
from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.plan.catalog import Efficiency, load_catalog
from chatfleet.plan.cost_model import GroupCost, ModelCost, StepCostModel
from chatfleet.plan.sim_bench import ReplicaPlan, sim_protocol, simulate_point
from chatfleet.plan.sim_replica import SIM_VOCAB, NullTokenizer
from chatfleet.plan.virtual_loop import VirtualClock, run_virtual

BLOCK = 4


def _cost(plan: SchedulerOutput) -> float:
    """A deterministic toy cost: 1 ms per step + 0.1 ms per token + 0.01 ms per context token."""
    return 1e-3 + sum(1e-4 * c.num_tokens + 1e-5 * c.context_length for c in plan.chunks)


def _decisions(plan: SchedulerOutput) -> tuple:
    """What the scheduler decided (token ids left out: fast mode samples other ids)."""
    chunks = tuple((c.request_id, c.num_tokens, c.start_position, tuple(c.block_table), c.sample) for c in plan.chunks)
    transfers = tuple((t.direction, t.device_block_ids, t.host_block_ids) for t in plan.kv_transfers)
    return chunks, tuple(plan.preempted_request_ids), tuple(plan.finished_request_ids), transfers


# (arrivals per second, longest reply): short replies in a burst, and long ones spread out (most
# steps then decode only, which the simulator runs through decode spans)
WORKLOADS = {"burst": (400.0, 12), "long-replies": (40.0, 60)}


def _workload(kind: str = "burst", seed: int = 7) -> list[tuple[float, str, list[int], int]]:
    """Requests sharing prefixes (two "cards"), arriving over time, too many for the pool at once."""
    rate, longest = WORKLOADS[kind]
    rng = random.Random(seed)
    cards = [[rng.randrange(1000, 5000) for _ in range(n)] for n in (37, 22)]
    out, t = [], 0.0
    for i in range(24):
        t += rng.expovariate(rate)
        prompt = cards[i % 2] + [rng.randrange(1000, 5000) for _ in range(rng.randrange(1, 30))]
        out.append((t, f"r{i}", prompt, rng.randrange(1, longest)))
    return out


def _config(host_blocks: int) -> EngineConfig:
    return EngineConfig(model="sim", max_model_len=512,
                        cache=CacheConfig(block_size=BLOCK, num_tokens=40 * BLOCK, host_memory_bytes=host_blocks),
                        scheduler=SchedulerConfig(max_batched_tokens=48, max_running=6))


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0.0)


def _engine_loop(host_blocks: int, kind: str = "burst") -> list[tuple]:
    """The reference: the engine stepped in a plain loop, content checks on, the clock advanced by
    the same cost per step; requests join before the first step that starts at or after arrival."""
    clock = VirtualClock()
    plans: list[tuple] = []

    def cost(plan):
        plans.append(_decisions(plan))
        return _cost(plan)

    runner = SimRunner(40, BLOCK, vocab_size=SIM_VOCAB, max_model_len=512, cost_model=cost, num_host_blocks=host_blocks)
    engine = Engine(_config(host_blocks), runner=runner, tokenizer=NullTokenizer(), clock=clock)
    pending = _workload(kind)
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and pending[0][0] > clock.now:
            clock.now = pending[0][0]
        while pending and pending[0][0] <= clock.now:
            t, rid, prompt, n = pending.pop(0)
            engine.add_request(rid, prompt, _params(n), arrival_time=t)
        before = runner.virtual_time
        engine.step()
        engine.check_integrity()
        clock.now += runner.virtual_time - before
    return plans


def _simulator(host_blocks: int, spans: list[int] | None = None, kind: str = "burst") -> list[tuple]:
    """The planner's path: SimReplica (fast mode, plain decode steps run by decode spans where it
    can) driven by coroutines on the virtual-time loop."""
    clock = VirtualClock()
    plans: list[tuple] = []
    replica = ReplicaPlan(_config(host_blocks), 40, host_blocks, _cost, fast=True).build(
        "r", clock, on_plan=lambda p: plans.append(_decisions(p)))

    async def main():
        loop_task = asyncio.create_task(replica.run())

        async def send(t, rid, prompt, n):
            await asyncio.sleep(t - clock())
            rec = RequestRecord(0, 0, 0, 0, t)
            tokens = await replica.generate(rid, prompt, n, rec, 0.0, t)
            assert rec.status == "ok" and len(tokens) == n == rec.output_tokens and len(rec.itl_s) == n - 1

        await asyncio.gather(*(send(*r) for r in _workload(kind)))
        replica.close()
        await loop_task

    run_virtual(main(), clock)
    if spans is not None:
        spans.append(replica.span_steps)
    return plans


@pytest.mark.parametrize("kind", list(WORKLOADS))
@pytest.mark.parametrize("host_blocks", [0, 16])
def test_simulator_makes_exactly_the_engines_scheduling_decisions(host_blocks, kind):
    reference = _engine_loop(host_blocks, kind)
    spans: list[int] = []
    simulated = _simulator(host_blocks, spans, kind)
    if kind == "long-replies":
        assert spans[0] > len(reference) // 8, "decode spans should run many of the steps"
    assert any(p[1] for p in reference), "the workload should force preemptions"
    assert any(c[2] > 0 for p in reference for c in p[0] if c[1] > 1), "and prefix hits"
    assert bool(host_blocks) == any(p[3] for p in reference), "and host-tier transfers when it has one"
    assert simulated == reference


def test_virtual_loop_takes_no_wall_time_and_keeps_timer_order():
    clock = VirtualClock()

    async def main():
        order = []

        async def at(d):
            await asyncio.sleep(d)
            order.append((d, clock()))

        await asyncio.gather(at(3600.0), at(1.5), at(86400.0))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(10):
                await asyncio.sleep(100)
        return order

    assert run_virtual(main(), clock) == [(1.5, 1.5), (3600.0, 3600.0), (86400.0, 86400.0)]


def test_a_failing_step_reaches_the_replicas_run():
    """Steps chain through timer callbacks; an error inside one still ends ``run()`` with it (no
    silent stall of the requests waiting on the replica)."""
    clock = VirtualClock()
    calls = []

    def cost(plan):
        calls.append(plan)
        if len(calls) == 3:
            raise RuntimeError("cost model broke")
        return _cost(plan)

    replica = ReplicaPlan(_config(0), 40, 0, cost, fast=True, decode_spans=False).build("r", clock)

    async def main():
        loop_task = asyncio.create_task(replica.run())
        record = RequestRecord(0, 0, 0, 0, 0.0)
        sender = asyncio.create_task(replica.generate("a", list(range(1, 9)), 6, record, 0.0, 0.0))
        with pytest.raises(RuntimeError, match="cost model broke"):
            await loop_task
        sender.cancel()

    run_virtual(main(), clock)
    assert len(calls) == 3


def test_virtual_loop_hears_a_wake_up_from_another_thread():
    """The loop skips the select system call unless a thread wrote to its self-pipe: a thread's
    ``call_soon_threadsafe`` must still be run (and the pipe drained) before a pending timer."""
    clock = VirtualClock()

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        seen = []
        worker = threading.Thread(target=lambda: loop.call_soon_threadsafe(fut.set_result, "from thread"))
        worker.start()
        worker.join()  # its callback and its byte in the self-pipe are both there now
        seen.append((await fut, clock()))
        await asyncio.sleep(5.0)
        seen.append(("timer", clock()))
        undrained = select.select([loop._ssock], [], [], 0)[0]  # the thread's byte left in the pipe
        return seen, undrained

    seen, undrained = run_virtual(main(), clock)
    assert seen == [("from thread", 0.0), ("timer", 5.0)]
    assert not undrained  # a real select saw the pipe and the loop drained it


def test_roofline_step_cost():
    gpu = load_catalog().get("H100")
    model = ModelCost(weight_bytes_per_step=16 * 10**9, linear_flops_per_token=2 * 8e9, query_width=4096,
                      groups=(GroupCost(36, 4096, None, 16 * 36 * 4096),), weights_precision="bf16")
    eff = Efficiency(compute=0.5, memory=0.8, pcie=1.0, step_overhead_ms=1.0)
    cm = StepCostModel(model, gpu, eff)
    p = _params(1)

    def chunk(n, start):
        return ScheduledChunk("x", [1] * n, start, [], True, p, 0)

    decode = cm.cost(SchedulerOutput([chunk(1, 999)]))  # one decode at context 1000
    kv = 36 * 4096 * (1000 + 1)
    assert decode.memory_s == pytest.approx((16e9 + kv) / (3350e9 * 0.8))
    assert decode.compute_s == pytest.approx((2 * 8e9 + 4 * 4096 * 36 * 1000) / (989.4e12 * 0.5))
    assert cm(SchedulerOutput([chunk(1, 999)])) == pytest.approx(1e-3 + decode.memory_s)  # memory bound
    prefill = cm.cost(SchedulerOutput([chunk(4096, 0)]))
    assert prefill.compute_s > prefill.memory_s  # a long prefill is compute bound
    assert prefill.compute_s == pytest.approx((4096 * 2 * 8e9 + 4 * 4096 * 36 * 4096 * 4097 / 2) / (989.4e12 * 0.5))


def test_simulated_point_writes_the_sweep_result_format(tmp_path):
    from chatfleet.plan.memory_report import read_model_config
    from chatfleet.plan.replica_setup import ServingConfig, replica_plan

    cfg, _ = read_model_config("tiny")
    plan = replica_plan(cfg, load_catalog().get("cpu"), ServingConfig(weights="fp32", kv_cache_tokens=4096))
    proto = sim_protocol(LoadSpec("closed", 4, duration_s=20, warmup_s=2), parse_slo("ttft_p99<=1s"))
    profile = get_profile("cpu-roleplay")
    res = simulate_point(proto, 4, lambda seed: Workload(profile, seed, EstimateCounter()), plan)
    run = res.points[0].runs[0]
    assert run.summary.requests > 10 and run.summary.ok == run.summary.requests
    assert all(r.ttft_s > 0 and r.output_tokens == r.expected_tokens for r in run.records if not r.warmup and r.end_s)
    assert run.summary.hit_rate and run.summary.hit_rate > 0.3  # returning turns hit their history
    path = write_json(result_document("sweep", {}, {"sim": sweep_to_dict(res)}), tmp_path / "r.json")
    # the open loop: new chats arrive as a Poisson process
    proto_open = sim_protocol(LoadSpec("open", 0.5, duration_s=20, warmup_s=2), parse_slo("ttft_p99<=1s"))
    run_open = simulate_point(proto_open, 0.5, lambda seed: Workload(profile, seed, EstimateCounter()),
                              plan).points[0].runs[0]
    assert 3 <= run_open.conversations <= 25 and run_open.summary.ok > 10
    assert load_result(path)["series"]["sim"]["points"][0]["level"] == 4


def test_coarse_time_charges_k_real_steps_and_reports_real_tokens():
    gpu = load_catalog().get("L4")
    model = ModelCost(10**9, 2e9, 1024, (GroupCost(8, 1024, None, 16 * 8 * 1024),), "bf16")
    exact, coarse = StepCostModel(model, gpu), StepCostModel(model, gpu, token_scale=4)
    p = _params(1)
    decode_sim = SchedulerOutput([ScheduledChunk("x", [1], 100, [], True, p, 0)])
    decode_real = SchedulerOutput([ScheduledChunk("x", [1], 401, [], True, p, 0)])  # 100 x 4 + (4 - 1) / 2
    assert coarse(decode_sim) == pytest.approx(4 * exact.cost(decode_real).total_s, rel=1e-3)

    from chatfleet.plan.memory_report import read_model_config
    from chatfleet.plan.replica_setup import ServingConfig, replica_plan

    cfg, _ = read_model_config("small")
    proto = sim_protocol(LoadSpec("closed", 6, duration_s=30, warmup_s=3), parse_slo("ttft_p99<=2s"))
    runs = {}
    for k in (1, 4):
        plan = replica_plan(cfg, load_catalog().get("cpu"), ServingConfig(weights="fp32", kv_cache_tokens=8192),
                            token_scale=k)
        assert plan.num_blocks == 8192 // 16 // k
        res = simulate_point(proto, 6, lambda seed: Workload(get_profile("cpu-roleplay"), seed, EstimateCounter()),
                             plan)
        runs[k] = res.points[0].runs[0]
    for k in (1, 4):
        done = [r for r in runs[k].records if r.status == "ok" and r.end_s is not None]
        assert done and all(r.output_tokens == r.expected_tokens == len(r.itl_s) + 1 for r in done)
    s1, s4 = runs[1].summary, runs[4].summary
    assert s4.latency["itl"]["p50"] == pytest.approx(s1.latency["itl"]["p50"], rel=0.25)
    assert s4.hit_rate == pytest.approx(s1.hit_rate, abs=0.1)


def test_decode_cost_is_the_same_float_as_the_plans_cost():
    rng = random.Random(3)
    p = _params(1)
    for name in ("H100", "L4", "cpu"):
        model = ModelCost(rng.randrange(10**8, 10**10), 2e9 * rng.random(), 4096,
                          (GroupCost(36, 4096, None, 16 * 36 * 4096), GroupCost(4, 512, None, 16 * 4 * 512)), "bf16")
        cm = StepCostModel(model, load_catalog().get(name))
        for _ in range(50):
            starts = [rng.randrange(0, 40000) for _ in range(rng.randrange(1, 300))]
            plan = SchedulerOutput([ScheduledChunk(f"r{i}", [1], s, [], True, p, 0) for i, s in enumerate(starts)])
            assert cm.decode_cost(len(starts), sum(starts)) == cm(plan)
            # a prefill or two beside the decodes (the planner's span steps that admit requests)
            longer = [(rng.randrange(0, 30000), rng.randrange(2, 2048)) for _ in range(rng.randrange(1, 3))]
            mixed = SchedulerOutput(plan.chunks + [ScheduledChunk(f"p{i}", [1] * n, s, [], i == 0, p, 0)
                                                   for i, (s, n) in enumerate(longer)])
            assert cm.batch_cost(len(starts), sum(starts), longer) == cm(mixed)
    windowed = ModelCost(10**9, 2e9, 1024, (GroupCost(8, 1024, 128, 16 * 8 * 1024),), "bf16")
    assert StepCostModel(windowed, load_catalog().get("L4")).decode_cost(2, 10) is None  # no closed form


def test_a_simulated_run_may_be_an_extension_run():
    """The sweep asks for more runs of an undecided point (``Bench.run_once(..., extension=True)``);
    the simulated bench answers as the measured one does, the run marked as an extension."""
    from chatfleet.plan.sim_bench import SimBench

    plan = ReplicaPlan(_config(0), 40, 0, _cost, fast=True)
    proto = sim_protocol(LoadSpec("closed", 2, duration_s=2, warmup_s=0), parse_slo("ttft_p99<=2s"))
    clock = VirtualClock()
    bench = SimBench(proto, lambda seed: Workload(get_profile("cpu-roleplay"), seed, EstimateCounter()), plan, clock)
    run = run_virtual(bench.run_once(2, 1, extension=True), clock)
    assert run.extension and run.repeat == 1 and run.records
