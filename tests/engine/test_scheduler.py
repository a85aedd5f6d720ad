"""Scheduler unit tests on the SimRunner: token budget, chunked prefill, caps, preemption, stops."""

import pytest

from chatfleet.engine.config import SchedulerConfig
from chatfleet.engine.kv.manager import PagedKVManager
from chatfleet.engine.outputs import RunnerOutput, SampledToken
from chatfleet.engine.request import Request, RequestStatus, SamplingParams
from chatfleet.engine.runner.sim_runner import SimRunner
from chatfleet.engine.scheduler import Scheduler
from chatfleet.engine.scheduling_policy import make_scheduling_policy
from chatfleet.errors import ConfigError, ServerOverloadedError

BS = 4


def make(num_blocks=64, max_model_len=1024, **cfg):
    kv = PagedKVManager(num_blocks, BS)
    sched = Scheduler(SchedulerConfig(**cfg), kv, max_model_len=max_model_len, eos_token_ids=frozenset({0}))
    return sched, SimRunner(num_blocks, BS, vocab_size=1000)


def req(rid, n, t=0.0, **params):
    params.setdefault("max_tokens", 8)
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    return Request(rid, [(7 * i + len(rid)) % 900 + 50 for i in range(n)], SamplingParams(**params),
                   eos_token_id=0, arrival_time=t)


def step(sched, runner):
    plan = sched.schedule()
    result = runner.execute(plan) if plan.chunks else RunnerOutput({})
    sched.update(plan, result)
    sched.check_integrity()
    return plan


def drain(sched, runner, limit=500):
    plans = []
    while sched.has_unfinished_requests():
        plans.append(step(sched, runner))
        assert len(plans) < limit, "scheduler made no progress"
    return plans


def test_long_prompt_is_chunked_while_running_requests_keep_decoding():
    sched, runner = make(max_batched_tokens=8)
    a, b = req("a", 3, 0.0, max_tokens=20), req("b", 3, 1.0, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # both prompts fit in one step
    assert a.num_output_tokens == b.num_output_tokens == 1
    long = req("long", 30, 2.0, max_tokens=2)
    sched.add_request(long)
    chunk_sizes = []
    while long.num_output_tokens == 0:
        plan = step(sched, runner)
        assert plan.num_batched_tokens <= 8
        by_id = {c.request_id: c for c in plan.chunks}
        assert by_id["a"].num_tokens == by_id["b"].num_tokens == 1  # decodes every step
        chunk_sizes.append(by_id["long"].num_tokens)
    assert chunk_sizes == [6, 6, 6, 6, 6]
    assert a.num_output_tokens == 6


def test_mixed_step_tokens_cut_prompt_chunks_beside_decodes_only():
    sched, runner = make(max_batched_tokens=32, mixed_step_tokens=6)
    first = req("first", 30, 0.0, max_tokens=20)
    sched.add_request(first)
    plan = step(sched, runner)  # nothing decodes yet: the whole budget
    assert [c.num_tokens for c in plan.chunks] == [30] and first.num_output_tokens == 1
    late = req("late", 30, 1.0, max_tokens=2)
    sched.add_request(late)
    sizes = []
    while late.num_output_tokens == 0:
        plan = step(sched, runner)
        by_id = {c.request_id: c.num_tokens for c in plan.chunks}
        assert by_id["first"] == 1 and plan.num_batched_tokens <= 6  # the decode always, then 5 prompt tokens
        sizes.append(by_id["late"])
    assert sizes == [5] * 6
    assert sched.step_budget(0) == 32 and sched.step_budget(2) == 6 and sched.step_budget(9) == 9
    sched, runner = make(max_batched_tokens=32, mixed_step_tokens=1)  # decodes never cut
    for rid in ("a", "b"):
        sched.add_request(req(rid, 3, 0.0, max_tokens=5))
    step(sched, runner)
    sched.add_request(req("c", 4, 1.0, max_tokens=5))
    plan = step(sched, runner)
    assert sorted(c.request_id for c in plan.chunks) == ["a", "b"]  # no room beside two decodes
    drain(sched, runner)
    with pytest.raises(ConfigError, match="mixed_step_tokens"):
        SchedulerConfig(mixed_step_tokens=0)


def test_decodes_go_before_an_earlier_unfinished_prompt():
    sched, runner = make(max_batched_tokens=4)
    short = req("s", 2, 1.0, max_tokens=10)
    sched.add_request(short)
    step(sched, runner)
    long = req("long", 20, 0.0)  # arrived earlier, so it sorts first among running requests
    sched.add_request(long)
    step(sched, runner)
    assert [r.request_id for r in sched.running] == ["long", "s"]
    while long.num_output_tokens == 0:
        plan = step(sched, runner)
        assert [(c.request_id, c.num_tokens) for c in plan.chunks][0] == ("s", 1)
        assert plan.num_batched_tokens <= 4 and plan.chunks[1].request_id == "long"


def test_max_running_caps_the_batch_and_max_waiting_bounds_the_queue():
    """A burst between two steps admits exactly max_running + max_waiting."""
    sched, runner = make(max_running=2, max_waiting=3)
    for i in range(5):
        sched.add_request(req(f"r{i}", 4, float(i)))
    with pytest.raises(ServerOverloadedError) as exc:
        sched.add_request(req("r5", 4, 5.0))
    assert exc.value.status_code == 503 and "--max-waiting 3" in exc.value.message
    plan = step(sched, runner)
    assert len(plan.chunks) == 2 and sched.num_running == 2 and sched.num_waiting == 3
    with pytest.raises(ServerOverloadedError):
        sched.add_request(req("r5", 4, 5.0))
    sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    sched.add_request(req("r5", 4, 5.0))  # a free batch slot is room again
    drain(sched, runner)


def test_preemption_by_recompute_sends_latest_arrival_to_the_front():
    sched, runner = make(num_blocks=6, max_batched_tokens=64)  # 24 tokens
    reqs = [req(f"r{i}", 8, float(i), max_tokens=12) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    assert sched.num_running == 3 - (1 if sched.num_waiting else 0)
    preempted = []
    while not preempted:
        preempted = step(sched, runner).preempted_request_ids
    assert preempted == ["r2"]
    r2 = reqs[2]
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_output_tokens > 0  # keeps its output
    assert sched.waiting.peek() is r2
    assert sched.num_preemptions >= 1
    drain(sched, runner)
    # Same tokens as each request alone (the SimRunner's output depends on the KV it reads).
    for r in reqs:
        alone, alone_runner = make()
        solo = req(r.request_id, 8, 0.0, max_tokens=12)
        alone.add_request(solo)
        drain(alone, alone_runner)
        assert r.output_token_ids == solo.output_token_ids
        assert r.status == RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_a_prompt_waits_for_room():
    sched, runner = make(max_batched_tokens=8, enable_chunked_prefill=False)
    sched.add_request(req("a", 3, 0.0))
    sched.add_request(req("b", 7, 1.0))
    plan = step(sched, runner)
    assert [c.request_id for c in plan.chunks] == ["a"]  # b (7) does not fit the 5 left
    plan = step(sched, runner)
    assert {c.request_id: c.num_tokens for c in plan.chunks} == {"a": 1, "b": 7}


@pytest.mark.parametrize(
    "params,token,status,reason",
    [
        (dict(max_tokens=3), 5, RequestStatus.FINISHED_LENGTH, None),
        (dict(ignore_eos=False), 0, RequestStatus.FINISHED_STOPPED, None),
        (dict(stop_token_ids=(5,)), 5, RequestStatus.FINISHED_STOPPED, 5),
        (dict(ignore_eos=True), 0, None, None),
    ],
)
def test_stop_conditions(params, token, status, reason):
    sched, _ = make()
    r = req("a", 4, **params)
    sched.add_request(r)
    statuses = []
    for _ in range(3):
        plan = sched.schedule()
        ups = sched.update(plan, RunnerOutput({"a": SampledToken(token)}))
        statuses.append(r.status)
        if r.is_finished:
            break
    if status is None:
        assert not r.is_finished
    else:
        assert r.status == status
        if params.get("max_tokens") != 3:
            assert len(statuses) == 1 and ups[0].stop_reason == reason


def test_min_tokens_delays_eos_and_max_model_len_caps():
    sched, _ = make(max_model_len=7)
    r = req("a", 4, max_tokens=3, min_tokens=2, ignore_eos=False)
    sched.add_request(r)
    plan = sched.schedule()
    sched.update(plan, RunnerOutput({"a": SampledToken(0)}))
    assert not r.is_finished  # eos before min_tokens does not stop
    plan = sched.schedule()
    sched.update(plan, RunnerOutput({"a": SampledToken(9)}))
    plan = sched.schedule()
    sched.update(plan, RunnerOutput({"a": SampledToken(9)}))
    assert r.status == RequestStatus.FINISHED_LENGTH  # 4 + 3 == max_model_len
    assert plan.chunks and sched.schedule().finished_request_ids == ["a"]


def test_abort_frees_blocks_now_and_is_reported_to_the_runner():
    sched, runner = make()
    sched.add_request(req("a", 9))
    step(sched, runner)
    assert sched.kv.num_blocks_of("a") == 3
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert sched.kv.pool.num_used_blocks == 0
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is None
    sched.check_integrity()
    assert sched.schedule().finished_request_ids == ["a"]


def test_unknown_policy_lists_valid_ones():
    with pytest.raises(ConfigError, match="fcfs"):
        make_scheduling_policy("shortest-job-first")


def test_scheduler_reads_time_from_the_injected_clock():
    kv = PagedKVManager(16, BS)
    now = [100.0]
    sched = Scheduler(SchedulerConfig(), kv, max_model_len=64, clock=lambda: now[0])
    r = req("a", 5)
    sched.add_request(r)
    now[0] = 142.5
    sched.schedule()
    assert r.first_scheduled_time == 142.5


def test_updates_are_values_with_the_queue_time_on_the_first_output_only():
    """A chunked prompt's update says nothing until its first token; that one carries the queue
    time (first scheduled - arrival), the counts and the status after the step; later ones none."""
    kv = PagedKVManager(16, BS)
    now = [10.0]
    sched = Scheduler(SchedulerConfig(max_batched_tokens=4), kv, max_model_len=64, clock=lambda: now[0])
    runner = SimRunner(16, BS, vocab_size=1000)
    r = req("a", 6, t=10.0, max_tokens=2)
    sched.add_request(r)
    now[0] = 12.5
    updates = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        updates.append(sched.update(plan, runner.execute(plan)))
    first, second = [u for step_updates in updates for u in step_updates]
    assert updates[0] == []  # the prompt's first chunk samples nothing
    assert first.request_id == "a" and first.new_token_ids == r.output_token_ids[:1]
    assert (first.num_prompt_tokens, first.num_cached_tokens, first.num_output_tokens) == (6, 0, 1)
    assert first.queue_time == 2.5 and first.status == RequestStatus.RUNNING and not first.finished
    assert second.queue_time is None and second.num_output_tokens == 2
    assert second.finished and second.finish_reason == "length"
