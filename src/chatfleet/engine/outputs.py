"""Named values passed between scheduler, runner and engine.

``Scheduler.schedule() -> SchedulerOutput``; ``Runner.execute(SchedulerOutput) -> RunnerOutput``;
``Scheduler.update(SchedulerOutput, RunnerOutput) -> list[RequestUpdate]``;
``OutputProcessor.process(list[RequestUpdate])`` and ``Engine.step() -> list[RequestOutput]``.
The runner never decides policy; the scheduler never touches tensors. Everything here is a
value: nothing downstream of the scheduler holds a ``Request``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from chatfleet.engine.request import RequestStatus, SamplingParams
from chatfleet.engine.structured.bitmask import TokenBitmask


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute ``token_ids`` (positions ``start_position`` ...) of one request this step."""

    request_id: str
    token_ids: list[int]
    start_position: int  # == request.num_computed_tokens before this step
    block_table: list[int]  # every KV block of the request, in order, covering the new tokens
    sample: bool  # True when this chunk reaches the request's last token: sample the next one
    sampling_params: SamplingParams
    num_output_tokens: int  # output tokens so far (min_tokens masking of EOS/stop ids)
    eos_token_id: int | None = None
    want_prompt_logprobs: bool = False  # runner returns logprobs of the chunk's tokens 1..n
    # the request's tokens so far, for penalties; only on sampling chunks whose params use them
    prompt_token_ids: tuple[int, ...] = ()
    output_token_ids: tuple[int, ...] = ()
    # Models with several KV layer groups (kv/hybrid.py): each group's table by name (sliding
    # groups have holes before their window). None: ``block_table`` serves every group.
    group_block_tables: dict[str, list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_length(self) -> int:
        """Tokens with KV after this step (attention span of the last new token)."""
        return self.start_position + len(self.token_ids)


class TransferDirection(enum.Enum):
    STORE = "store"  # device -> host (a demotion)
    LOAD = "load"  # host -> device (a promotion)


@dataclass(frozen=True)
class KVTransfer:
    """Copy whole KV blocks between the device pool and the host pool, pairwise:
    ``device_block_ids[i]`` <-> ``host_block_ids[i]`` in every layer."""

    direction: TransferDirection
    device_block_ids: tuple[int, ...]
    host_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.device_block_ids) != len(self.host_block_ids):
            raise ValueError("a KV transfer pairs device and host blocks one to one")

    @property
    def num_blocks(self) -> int:
        return len(self.device_block_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # runner frees per-request state
    # executed before the forward pass, stores before loads (a block demoted this step may be
    # the destination of a load in the same step)
    kv_transfers: list[KVTransfer] = field(default_factory=list)
    token_bitmask: TokenBitmask | None = None  # set by the engine when constrained requests sample

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.kv_transfers


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None = None  # present when sampling_params.logprobs is not None


@dataclass(frozen=True)
class TransferStats:
    """What executing a plan's KV transfers cost."""

    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    seconds_storing: float = 0.0
    seconds_loading: float = 0.0


NO_TRANSFERS = TransferStats()


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, SampledToken]  # only for chunks with sample=True
    # logprobs of the chunk's input tokens at positions start+1..start+n-1 (and the
    # next chunk's first token is scored by this chunk's last position), for echo scoring
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    kv_transfer: TransferStats = NO_TRANSFERS


class RequestUpdate(NamedTuple):
    """What one step did to one request, for the output processor (a tuple: one is built per
    sampled token, so it is made in C).

    ``status`` is the request's status after the step; the counts are after it too.
    ``queue_time`` (first scheduled - arrival, seconds) is set on the update of the request's
    first output token only."""

    request_id: str
    new_token_ids: list[int]
    status: RequestStatus
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix-cache hit at first scheduling (0 before)
    num_output_tokens: int
    new_logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # this chunk's entries
    prompt_logprobs_restart: bool = False  # the chunk started at position 0: drop earlier entries
    stop_reason: int | None = None  # the stop token id that finished it
    queue_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason


@dataclass(frozen=True)
class RequestOutput:
    """What a caller of ``Engine.step()`` sees for one request this step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None  # one per new token when requested
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on the first output; [0] is None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # on the request's first output: first scheduled - arrival, seconds (a measurement, not compared)
    queue_time: float | None = field(default=None, compare=False)
