"""A request as the scheduler sees it, and the sampling parameters it carries."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chatfleet.engine.structured.spec import GrammarSpec
from chatfleet.errors import InvalidRequestError

if TYPE_CHECKING:
    from chatfleet.engine.block_hash import BlockHash


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything above PREEMPTED is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. Validated on construction; errors are client errors (400)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: no logprobs; k>=0: sampled token's logprob plus top-k
    prompt_logprobs: int | None = None  # for echo scoring; disables prefix-cache reuse
    # Penalties and biases, applied to the logits before temperature (runner/sampler.py):
    presence_penalty: float = 0.0  # OpenAI: minus this for each token already in the output
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # HF/vLLM: tokens in prompt or output: logit / p if > 0, else * p
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely (after temperature)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    grammar: GrammarSpec | None = None  # structured output: the reply follows this grammar

    def __post_init__(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise InvalidRequestError(msg, param=param)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        if self.temperature < 0 or self.temperature != self.temperature:
            bad(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not (0.0 < self.top_p <= 1.0):
            bad(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < -1:
            bad(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}", "top_k")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}", "min_tokens")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                bad("stop strings must be non-empty strings", "stop")
        if len(self.stop) > 16:
            bad("at most 16 stop strings are allowed", "stop")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                bad("stop_token_ids must be non-negative integers", "stop_token_ids")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}", "repetition_penalty")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for t, b in self.logit_bias:
            if not isinstance(t, int) or t < 0 or not -100.0 <= b <= 100.0:
                bad("logit_bias maps token ids >= 0 to biases in [-100, 100]", "logit_bias")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not (0 <= v <= MAX_TOP_LOGPROBS):
                bad(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {v}", name)

    @property
    def uses_token_history(self) -> bool:
        """Whether sampling reads the tokens so far (penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(eq=False, slots=True)
class Request:
    """Scheduler state of one request: ``num_computed_tokens`` catches up to ``num_tokens``.

    There is no prefill or decode phase: a prompt chunk, a prefix-cache hit and a decode step are
    all "compute the next tokens that have no KV yet".
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    cache_salt: str | None = None  # extra key for the prefix hash (tenant isolation)
    session_id: str | None = None  # the conversation (X-Session-ID or the OpenAI `user` field)
    first_scheduled_time: float | None = None
    # hashes of the full blocks computed so far, extended as the request grows (kv/manager.py)
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
