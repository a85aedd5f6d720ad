"""The tokenizing worker processes: the same ids as the tokenizer, an early refusal of a text
that cannot fit, and a CPU priority below the server's (a burst of long prompts queues there,
not the step loop for a core)."""

from __future__ import annotations

import asyncio
import os

from chatfleet.engine.api.tokenize_process import TokenizerProcesses, TooManyTokens
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.tokenizer import ChatTokenizer
from chatfleet.protocol.worker_priority import WORKER_NICENESS


def test_workers_encode_as_the_tokenizer_does_and_run_below_the_servers_priority():
    tokenizer = ChatTokenizer.from_pretrained(resolve_model("tiny")).backend
    text = "the harbor lights went out one by one " * 400  # over INLINE_CHARS: encoded by a worker
    workers = TokenizerProcesses(tokenizer)

    async def run():
        return await workers.encode(text, 100_000), await workers.encode(text, 50)

    try:
        ids, refused = asyncio.run(run())
        pids = list(workers._pool._processes)  # noqa: SLF001 - the workers' pids, to read their priority
        niceness = [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids]
    finally:
        workers.close()
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    assert isinstance(refused, TooManyTokens) and refused > 50
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert pids and niceness == [min(19, mine + WORKER_NICENESS)] * len(pids)
