"""Output processing: incremental text, stop strings (also split across tokens), logprobs."""

import pytest

from chatfleet.engine.output_processor import OutputProcessor
from chatfleet.engine.outputs import RequestUpdate, TokenLogprob
from chatfleet.engine.request import RequestStatus, SamplingParams
from chatfleet.engine.runner.sim_runner import make_byte_tokenizer

TOK = make_byte_tokenizer()
EOS = TOK.eos_token_id


def run(text_or_ids, finish_last=None, per_step=1, **params):
    """Feed tokens ``per_step`` at a time; the last update finishes with ``finish_last``."""
    params.setdefault("max_tokens", 200)
    ids = TOK.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
    prompt = TOK.encode("hi")
    proc = OutputProcessor(TOK)
    proc.add_request("a", prompt, SamplingParams(**params))
    outs, stopped = [], []
    for i in range(0, len(ids), per_step):
        new = ids[i : i + per_step]
        status = RequestStatus.RUNNING
        if i + per_step >= len(ids) and finish_last is not None:
            status = finish_last
        lps = [TokenLogprob(t, -1.0) for t in new]
        step = proc.process([RequestUpdate("a", new, status, len(prompt), 0, i + len(new), lps)])
        stopped += step.stopped
        outs += step.outputs
        if outs and outs[-1].finished:
            break
    return outs, stopped, proc


def text(outs):
    return "".join(o.new_text for o in outs)


def test_text_is_streamed_whole_characters():
    outs, _, proc = run("héllo, 世界!", RequestStatus.FINISHED_LENGTH)
    assert text(outs) == "héllo, 世界!"
    assert all("\ufffd" not in o.new_text for o in outs)
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert proc.num_requests == 0


def test_stop_string_split_across_tokens_is_cut_and_never_streamed():
    outs, stopped, proc = run("Hello END world", stop=("END",))
    assert text(outs) == "Hello "
    assert outs[-1].finished and outs[-1].finish_reason == "stop" and outs[-1].stop_reason == "END"
    assert [s.request_id for s in stopped] == ["a"] and [s.stop for s in stopped] == ["END"]
    assert proc.num_requests == 0
    # While streaming, the possible start of a stop string is held back.
    assert all("E" not in o.new_text for o in outs)


def test_stop_string_included_when_asked_and_earliest_wins():
    outs, _, _ = run("ab--cd==ef", stop=("==", "--"), include_stop_str_in_output=True, per_step=10)
    assert text(outs) == "ab--"
    outs, _, _ = run("xyz", stop=("q",), per_step=2)
    assert text(outs) == "xyz"  # a one-character stop string holds nothing back


def test_held_back_text_is_flushed_at_the_end():
    outs, _, _ = run("abcSTO", RequestStatus.FINISHED_LENGTH, stop=("STOP",))
    assert text(outs) == "abcSTO"


def test_eos_is_not_in_the_text_unless_asked():
    ids = TOK.encode("ok") + [EOS]
    outs, _, _ = run(ids, RequestStatus.FINISHED_STOPPED)
    assert text(outs) == "ok" and outs[-1].finish_reason == "stop"
    assert outs[-1].new_token_ids == [EOS]


def test_logprobs_only_when_requested_and_prompt_logprobs_on_first_output():
    outs, _, _ = run("ab", RequestStatus.FINISHED_LENGTH)
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs)
    proc = OutputProcessor(TOK)
    proc.add_request("b", [1, 2, 3], SamplingParams(max_tokens=5, logprobs=0, prompt_logprobs=0))
    lp = [TokenLogprob(2, -0.5), TokenLogprob(3, -0.25)]
    running = RequestStatus.RUNNING
    assert proc.process([RequestUpdate("b", [], running, 3, 0, 0, None, lp[:1], True)]).outputs == []
    (out,) = proc.process([RequestUpdate("b", [65], running, 3, 0, 1, [TokenLogprob(65, -2.0)], lp[1:],
                                         queue_time=0.25)]).outputs
    assert out.prompt_logprobs == [None, *lp]
    assert out.logprobs == [TokenLogprob(65, -2.0)]
    assert out.queue_time == 0.25 and out.num_prompt_tokens == 3
    (out,) = proc.process([RequestUpdate("b", [66], running, 3, 0, 2, [TokenLogprob(66, -1.0)])]).outputs
    assert out.prompt_logprobs is None and out.num_output_tokens == 2 and out.queue_time is None


@pytest.mark.parametrize("per_step", [1, 2, 3])
def test_chunking_of_tokens_does_not_change_the_text(per_step):
    sample = "Grüße — ¿qué tal? Привет, 안녕하세요"
    outs, _, _ = run(sample, RequestStatus.FINISHED_LENGTH, per_step=per_step, stop=("XYZ",))
    assert text(outs) == sample
