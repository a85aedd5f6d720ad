"""Turns scheduler updates into ``RequestOutput``s: incremental text, stop strings, logprobs.

Text is produced by the tokenizer's incremental detokenizer. While stop strings are set, the
last ``len(longest stop) - 1`` characters are held back so a stop string split across tokens
is never streamed before it is recognised. A stop string finishes the request; the engine then
frees its blocks. It reads only the updates' values and what ``add_request`` gave it (the
sampling parameters, the prompt for the detokenizer); it never sees a ``Request``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatfleet.engine.outputs import RequestOutput, RequestUpdate, TokenLogprob
from chatfleet.engine.request import RequestStatus, SamplingParams


@dataclass(frozen=True)
class StopStringHit:
    request_id: str
    stop: str


@dataclass(slots=True)
class _State:
    params: SamplingParams
    detokenizer: Any
    text: str = ""  # output text so far, already cut at a stop string
    sent: int = 0  # characters of ``text`` already emitted
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_output_sent: bool = False


@dataclass(frozen=True)
class ProcessedStep:
    outputs: list[RequestOutput]
    stopped: list[StopStringHit]  # requests a stop string finished: the engine must free them


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _State] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._states[request_id] = _State(params, self.tokenizer.incremental_detokenizer(prompt_token_ids))

    def remove_request(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._states)

    def process(self, updates: list[RequestUpdate]) -> ProcessedStep:
        outputs: list[RequestOutput] = []
        stopped: list[StopStringHit] = []
        for u in updates:
            state = self._states.get(u.request_id)
            if state is None:
                continue
            if u.prompt_logprobs is not None:
                if u.prompt_logprobs_restart:
                    state.prompt_logprobs.clear()
                state.prompt_logprobs.extend(u.prompt_logprobs)
            if not u.new_token_ids:
                continue
            output, hit = self._process_tokens(state, u)
            outputs.append(output)
            if hit is not None:
                stopped.append(hit)
            if output.finished:
                del self._states[u.request_id]
        return ProcessedStep(outputs, stopped)

    def _process_tokens(self, state: _State, u: RequestUpdate) -> tuple[RequestOutput, StopStringHit | None]:
        params = state.params
        finished = engine_finished = u.status.is_finished
        token_ids = u.new_token_ids
        if finished and u.status == RequestStatus.FINISHED_STOPPED and not params.include_stop_str_in_output:
            token_ids = token_ids[:-1]  # an eos or stop token id is not part of the text
        delta = state.detokenizer.add_tokens(token_ids) if token_ids else ""
        if finished:
            delta += state.detokenizer.flush()
        stop_str = None
        if delta:
            old_len = len(state.text)
            state.text += delta
            if params.stop:
                stop_str = self._cut_at_stop(state, old_len, params.stop, params.include_stop_str_in_output)
        if stop_str is not None:
            finished = True
        finish_reason = "stop" if stop_str is not None else u.status.finish_reason if finished else None
        hold = 0 if finished or not params.stop else max(len(s) for s in params.stop) - 1
        end = max(state.sent, len(state.text) - hold)
        new_text = state.text[state.sent : end]
        state.sent = end
        prompt_lp = None
        if not state.first_output_sent:
            state.first_output_sent = True
            if params.prompt_logprobs is not None:
                prompt_lp = [None, *state.prompt_logprobs]
        output = RequestOutput(
            request_id=u.request_id,
            new_token_ids=list(u.new_token_ids),
            new_text=new_text,
            finished=finished,
            finish_reason=finish_reason,
            num_prompt_tokens=u.num_prompt_tokens,
            num_cached_tokens=u.num_cached_tokens,
            num_output_tokens=u.num_output_tokens,
            logprobs=u.new_logprobs if params.logprobs is not None else None,
            prompt_logprobs=prompt_lp,
            stop_reason=stop_str if stop_str is not None else u.stop_reason,
            queue_time=u.queue_time,
        )
        hit = None
        if stop_str is not None and not engine_finished:
            hit = StopStringHit(u.request_id, stop_str)
        return output, hit

    @staticmethod
    def _cut_at_stop(state: _State, old_len: int, stops: tuple[str, ...], include: bool) -> str | None:
        """Cut ``state.text`` at the earliest stop string that ends in the new text."""
        best: tuple[int, str] | None = None
        for s in stops:
            i = state.text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        state.text = state.text[: i + len(s)] if include else state.text[:i]
        return s
