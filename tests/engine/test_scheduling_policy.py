"""Scheduling policies on the SimRunner: lpm order (host hits at their reload weight), the
max-wait guard, admission that is not head-of-line, and fcfs staying head-of-line."""

import pytest

from chatfleet.engine.config import SchedulerConfig
from chatfleet.engine.kv.manager import PagedKVManager
from chatfleet.engine.outputs import RunnerOutput
from chatfleet.engine.request import Request, SamplingParams
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.engine.scheduler import Scheduler
from chatfleet.engine.scheduling_policy import SCHEDULING_POLICIES
from chatfleet.errors import ConfigError

BS = 4
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make(num_blocks=64, num_host_blocks=0, **cfg):
    clock = Clock()
    kv = PagedKVManager(num_blocks, BS, num_host_blocks=num_host_blocks, clock=clock)
    sched = Scheduler(SchedulerConfig(**cfg), kv, max_model_len=1024, clock=clock)
    return sched, SimRunner(num_blocks, BS, vocab_size=1000, num_host_blocks=num_host_blocks), clock


def req(rid, tokens, t):
    return Request(rid, list(tokens), PARAMS, arrival_time=t)


def step(sched, runner):
    plan = sched.schedule()
    result = runner.execute(plan) if not plan.is_empty else RunnerOutput({})
    sched.update(plan, result)
    sched.check_integrity()
    return plan


def drain(sched, runner):
    for _ in range(500):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("no progress")


def warm(sched, runner, rid, tokens):
    sched.add_request(req(rid, tokens, sched.clock()))
    drain(sched, runner)


SHARED = list(range(100, 132))  # 8 blocks


def test_registry_and_config_validation():
    assert SCHEDULING_POLICIES.names == ["fcfs", "lpm"]
    with pytest.raises(ConfigError, match="fcfs, lpm"):
        SchedulerConfig(policy="sjf")
    with pytest.raises(ConfigError):
        SchedulerConfig(max_queue_delay=-1)


def test_lpm_admits_the_longest_cached_prefix_first():
    sched, runner, clock = make(policy="lpm", max_running=1)
    warm(sched, runner, "warm", SHARED + [1])
    clock.now = 1.0
    sched.add_request(req("cold", range(500, 540), 1.0))  # arrived first, nothing cached
    sched.add_request(req("hit", SHARED + [7, 8, 9], 1.1))
    plan = step(sched, runner)
    assert [c.request_id for c in plan.chunks] == ["hit"]
    assert plan.chunks[0].start_position == len(SHARED)
    fcfs, fr, _ = make(policy="fcfs", max_running=1)
    warm(fcfs, fr, "warm", SHARED + [1])
    fcfs.add_request(req("cold", range(500, 540), 1.0))
    fcfs.add_request(req("hit", SHARED + [7, 8, 9], 1.1))
    assert [c.request_id for c in step(fcfs, fr).chunks] == ["cold"]


def test_lpm_weights_host_hits_below_device_hits():
    # "dev" has 4 blocks on the device; "host" has 6 blocks only in the host tier
    sched, runner, clock = make(num_blocks=14, num_host_blocks=32, policy="lpm", max_running=1,
                                lpm_host_weight=0.5)
    host_prefix = list(range(300, 324))
    warm(sched, runner, "h", host_prefix + [1])
    warm(sched, runner, "filler", range(600, 648))  # pushes h's blocks to the host tier
    dev_prefix = list(range(200, 216))
    warm(sched, runner, "d", dev_prefix + [1])
    assert sched.kv.match_prefix(req("probe", host_prefix + [5], 0)).host_tokens == 24
    assert sched.kv.match_prefix(req("probe2", dev_prefix + [5], 0)).device_tokens == 16
    clock.now = 5.0
    sched.add_request(req("host", host_prefix + [5], 5.0))  # 24 * 0.5 = 12 < 16
    sched.add_request(req("dev", dev_prefix + [5], 5.1))
    assert [c.request_id for c in step(sched, runner).chunks] == ["dev"]
    drain(sched, runner)


def test_lpm_max_wait_guard_lets_nothing_starve():
    sched, runner, clock = make(policy="lpm", max_running=1, max_queue_delay=2.0)
    warm(sched, runner, "warm", SHARED + [1])
    clock.now = 10.0
    sched.add_request(req("old-cold", range(500, 520), 10.0))
    clock.now = 13.0  # old-cold has waited 3 s > 2 s
    sched.add_request(req("hit", SHARED + [7], 13.0))
    assert [c.request_id for c in step(sched, runner).chunks] == ["old-cold"]


def test_admission_is_not_head_of_line_within_the_guard():
    # 10 blocks: "big" (36 tokens = 9 blocks + decode) cannot fit while "run" holds 3
    sched, runner, clock = make(num_blocks=10, policy="lpm", max_queue_delay=5.0, max_batched_tokens=64)
    sched.add_request(Request("run", list(range(10)), SamplingParams(max_tokens=30, temperature=0.0,
                                                                     ignore_eos=True), arrival_time=0.0))
    step(sched, runner)
    clock.now = 1.0
    sched.add_request(req("big", range(400, 436), 1.0))
    sched.add_request(req("small", range(700, 704), 1.1))
    plan = step(sched, runner)
    assert {c.request_id for c in plan.chunks} == {"run", "small"}  # small passed big
    clock.now = 7.0  # big is overdue now: nothing passes it any more
    sched.add_request(req("small2", range(800, 804), 7.0))
    while "small" in sched.requests:
        step(sched, runner)
    plan = step(sched, runner)
    assert "small2" not in {c.request_id for c in plan.chunks}
    drain(sched, runner)
    assert not sched.requests


def test_fcfs_is_head_of_line():
    sched, runner, clock = make(num_blocks=10, policy="fcfs", max_batched_tokens=64)
    sched.add_request(Request("run", list(range(10)), SamplingParams(max_tokens=30, temperature=0.0,
                                                                     ignore_eos=True), arrival_time=0.0))
    step(sched, runner)
    sched.add_request(req("big", range(400, 436), 1.0))
    sched.add_request(req("small", range(700, 704), 1.1))
    assert {c.request_id for c in step(sched, runner).chunks} == {"run"}
    drain(sched, runner)


def test_lpm_sorts_a_long_queue_without_a_cap():
    sched, runner, clock = make(num_blocks=512, policy="lpm", max_running=1, max_waiting=4096)
    warm(sched, runner, "warm", SHARED + [1])
    clock.now = 1.0
    for i in range(600):
        sched.add_request(req(f"c{i}", range(1000 + 10 * i, 1000 + 10 * i + 9), 1.0 + i * 1e-4))
    sched.add_request(req("hit", SHARED + [3], 1.5))  # the 601st waiting request
    assert [c.request_id for c in step(sched, runner).chunks] == ["hit"]
