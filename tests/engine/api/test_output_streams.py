"""Per-request output streams: outputs reach their own request, a stream ends at its finishing
output, an error finish and an engine failure are raised, and ``finished`` says who holds it."""

import asyncio

import pytest

from chatfleet.engine.api.output_streams import OutputStreams, RequestFailedError
from chatfleet.engine.outputs import RequestOutput
from chatfleet.errors import EngineDeadError, InvalidRequestError


def out(rid: str, token: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(rid, [token], str(token), finish is not None, finish, 3, 0, token)


async def collect(stream) -> list[int]:
    return [o.new_token_ids[0] for o in [o async for o in stream.follow()]]


def test_outputs_reach_their_own_stream_and_end_at_the_finish():
    async def run():
        streams = OutputStreams()
        a, b = streams.open("a"), streams.open("b")
        streams.dispatch([out("a", 1), out("b", 7), out("x", 9), out("a", 2, "length"), out("b", 8, "stop")])
        streams.dispatch([out("a", 3)])  # after the finish: never read
        got = await collect(a), await collect(b)
        assert a.finished and b.finished
        streams.close(a)
        streams.close(b)
        return got, len(streams)

    assert asyncio.run(run()) == (([1, 2], [7, 8]), 0)


def test_an_error_finish_and_an_engine_failure_are_raised():
    async def run():
        streams = OutputStreams()
        a, b = streams.open("a"), streams.open("b")
        streams.dispatch([out("a", 1, "error")])
        with pytest.raises(RequestFailedError, match="request a failed"):
            await collect(a)
        streams.fail_all(EngineDeadError("gone"))
        with pytest.raises(EngineDeadError):
            await collect(b)
        assert a.finished and b.finished

    asyncio.run(run())


def test_a_stream_left_early_is_not_finished_and_ids_are_unique_while_open():
    async def run():
        streams = OutputStreams()
        a = streams.open("a")
        with pytest.raises(InvalidRequestError, match="already in flight"):
            streams.open("a")
        streams.dispatch([out("a", 1)])
        gen = a.follow()
        assert (await anext(gen)).new_token_ids == [1]
        await gen.aclose()
        assert not a.finished  # the engine still holds it: the caller aborts it
        streams.close(a)
        assert streams.open("a") is not a

    asyncio.run(run())
