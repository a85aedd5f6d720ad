"""The engine's OpenAPI document matches its behaviour: schemathesis, every check it has (status
codes and content types as documented, response bodies against their schemas, valid data
accepted, invalid data refused, Allow on 405...), bounded examples per operation."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.api.async_engine import AsyncEngine
from chatfleet.engine.api.server import build_app
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from chatfleet.engine.engine import Engine
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.runner.torch_runner import TorchRunner
from chatfleet.loopback import ServerThread
from chatfleet.testing.openapi_checks import schemathesis_failures

BS = 16
NUM_BLOCKS = 64
EXAMPLES = 6


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(resolve_model("tiny"), dtype="float32")
    config = EngineConfig(model="tiny", max_model_len=128,
                          cache=CacheConfig(block_size=BS, num_tokens=NUM_BLOCKS * BS),
                          scheduler=SchedulerConfig(max_batched_tokens=256))
    engine = AsyncEngine(Engine(config, runner=TorchRunner(loaded, NUM_BLOCKS, BS), tokenizer=loaded.tokenizer))
    with ServerThread(build_app(engine)) as srv:
        yield srv
    torch.set_num_threads(threads)


def unstatable(error: dict) -> bool:
    """The rules a JSON schema cannot state: the prompt's tokens (plus max_tokens) fit the context;
    min_tokens <= max_tokens; a named tool_choice names one of the tools; prompts times n at most
    fanout.MAX_CHOICES (one value against another)."""
    message = error.get("message", "")
    return error.get("code") == "context_length_exceeded" or (
        error.get("param") == "n" and "choices (prompts times n)" in message) or (
        error.get("param") == "min_tokens" and "max_tokens" in message) or (
        error.get("param") == "tool_choice" and "not among the request's tools" in message)


def test_every_schemathesis_check_passes_on_every_operation(server):
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    def exclude(response) -> list:
        # A rule no schema can state, refused: checked as any other response, but not as a valid
        # request rejected.
        if response.status_code == 400 and unstatable(response.json()["error"]):
            return [positive_data_acceptance]
        return []

    failures = schemathesis_failures(server.url, EXAMPLES, timeout=60, exclude=exclude)
    assert not failures, "\n".join(failures[:8])
