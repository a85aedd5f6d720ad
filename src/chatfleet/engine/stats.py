"""The engine's counters and gauges at one moment (``Engine.stats()``), for /metrics and tests."""

from __future__ import annotations

from dataclasses import dataclass

from chatfleet.engine.outputs import RequestOutput, TransferStats

__all__ = ["EngineStats", "OutputCounts", "TransferTotals"]


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # blocks referenced by requests / total (0..1)
    num_blocks: int
    block_size: int
    num_cached_blocks: int  # blocks holding a prefix hash (in use or not)
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    num_evictions: int  # cached blocks reused for other content
    prompt_tokens: int
    generation_tokens: int
    num_finished: int  # requests that finished with stop or length
    # host tier (None without one)
    host_num_blocks: int | None = None
    host_num_cached_blocks: int | None = None
    host_cache_queries: int | None = None  # tokens the device cache missed, looked up in host memory
    host_cache_hits: int | None = None  # tokens found there
    host_promotions: int | None = None  # blocks loaded host -> device
    host_demotions: int | None = None  # blocks stored device -> host
    host_demotions_skipped: int | None = None  # device evictions the host already held
    host_demotions_dropped: int | None = None  # device evictions lost (every host block in flight)
    host_evictions: int | None = None  # host blocks reused for other contents
    kv_bytes_loaded: int | None = None
    kv_bytes_stored: int | None = None
    kv_seconds_loading: float | None = None
    kv_seconds_storing: float | None = None

    @property
    def host_cache_misses(self) -> int | None:
        if self.host_cache_queries is None or self.host_cache_hits is None:
            return None
        return self.host_cache_queries - self.host_cache_hits

    @property
    def host_usage(self) -> float | None:
        if not self.host_num_blocks or self.host_num_cached_blocks is None:
            return None
        return self.host_num_cached_blocks / self.host_num_blocks


@dataclass(slots=True)
class OutputCounts:
    """Tokens and requests the engine's steps produced (``Engine.step()`` and its decode spans,
    ``engine/decode_span.py``, which count here themselves)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_finished: int = 0

    def count(self, outputs: list[RequestOutput]) -> None:
        """Count a step's outputs."""
        for out in outputs:
            self.generation_tokens += len(out.new_token_ids)
            if out.num_output_tokens == len(out.new_token_ids):
                self.prompt_tokens += out.num_prompt_tokens  # first output of the request
            if out.finished:
                self.num_finished += 1


@dataclass
class TransferTotals:
    """KV transfer costs summed over the engine's life."""

    bytes_loaded: int = 0
    bytes_stored: int = 0
    seconds_loading: float = 0.0
    seconds_storing: float = 0.0

    def add(self, s: TransferStats) -> None:
        self.bytes_loaded += s.bytes_loaded
        self.bytes_stored += s.bytes_stored
        self.seconds_loading += s.seconds_loading
        self.seconds_storing += s.seconds_storing
