"""One record per request sent: times, tokens, outcome. Errors are records too, never dropped."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STATUSES = ("ok", "error", "rate_limited", "timeout")


@dataclass
class RequestRecord:
    """Times in seconds from the run's start; latencies measured from the intended send time."""

    conv_id: int
    turn: int
    character_id: int
    slot: int
    intended_s: float  # when the request should have gone out (previous end + think time)
    sent_s: float | None = None  # when it did go out (after client-side queueing)
    first_token_s: float | None = None
    end_s: float | None = None
    ttft_s: float | None = None  # first content token - intended
    reply_s: float | None = None  # last token - intended
    queue_s: float | None = None  # sent - intended: time queued in the client
    itl_s: list[float] = field(default_factory=list)  # one gap per token after the first
    output_tokens: int = 0
    expected_tokens: int = 0  # forced reply length (min_tokens = max_tokens)
    prompt_tokens: int | None = None  # from usage
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    status: str = "ok"
    http_status: int | None = None
    error: str | None = None
    warmup: bool = False  # sent before the measured window; excluded from stats
    pause_s: float | None = None  # the user's pause before this turn (None: a conversation's first turn)
    session_id: str | None = None  # sent as X-Session-ID


    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> RequestRecord:
        return cls(**{k: v for k, v in d.items() if k in _FIELDS})

    def slo_values(self) -> dict:
        return {"ttft": self.ttft_s, "itl": self.itl_s, "reply": self.reply_s, "queue": self.queue_s}


_FIELDS = frozenset(RequestRecord.__dataclass_fields__)
