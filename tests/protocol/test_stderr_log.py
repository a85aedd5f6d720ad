import io
import logging
import sys

from chatfleet.protocol.stderr_log import CurrentStderrHandler


def test_the_handler_writes_to_the_stderr_of_the_moment_not_the_one_it_was_made_with(monkeypatch):
    logger = logging.getLogger("chatfleet.test_stderr_log")
    logger.propagate = False
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = CurrentStderrHandler()
    logger.addHandler(handler)
    try:
        logger.warning("one")
        first.close()  # what a finished test's capture does to the stream a handler was made with
        monkeypatch.setattr(sys, "stderr", second)
        logger.warning("two")
    finally:
        logger.removeHandler(handler)
    assert second.getvalue() == "two\n"


def test_a_plain_stream_handler_would_have_failed_there(monkeypatch):
    """The oracle: the same sequence with logging's own handler hits the closed stream."""
    first = io.StringIO()
    handler = logging.StreamHandler(first)
    first.close()
    errors = []
    monkeypatch.setattr(handler, "handleError", lambda record: errors.append(sys.exc_info()[0]))
    handler.emit(logging.makeLogRecord({"msg": "two"}))
    assert errors == [ValueError]
