"""The runner contract: execute one scheduler plan on tensors (or a model of them)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from chatfleet.engine.outputs import RunnerOutput, SchedulerOutput


@runtime_checkable
class Runner(Protocol):
    """Executes ``SchedulerOutput`` plans; never decides policy.

    ``num_blocks`` x ``block_size`` is the KV pool the scheduler's KV manager hands out; a runner
    with a host tier also has ``num_host_blocks`` (host memory blocks of the same size) and
    executes ``SchedulerOutput.kv_transfers`` before the forward pass, stores before loads
    (``runner/kv_transfer.py``), reporting their cost in ``RunnerOutput.kv_transfer``.
    Per-request state (sampling generators) lives until the id appears in
    ``SchedulerOutput.finished_request_ids``; preempted requests keep theirs.
    """

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput: ...
