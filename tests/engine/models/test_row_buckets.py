"""Row buckets: the padded row count, and that padding rows never reach the step's tokens (the
model's output over a bucketed step equals the unpadded one's)."""

from __future__ import annotations

import os

import pytest
import torch

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models import qwen3, row_buckets
from chatfleet.engine.models.dtype import native_bf16
from chatfleet.engine.models.linear import onednn_available
from chatfleet.engine.models.loader import load_model
from chatfleet.engine.models.prefill_attention import runs_in_onednn
from chatfleet.native_caches import BOUND_MARK, CACHE_ENTRIES, ONEDNN_PRIMITIVE_CACHE


def test_padded_rows_keeps_small_steps_and_rounds_the_rest_up_to_a_bucket():
    for tokens in range(1, 3000):
        rows = row_buckets.padded_rows(tokens)
        assert rows >= tokens and rows - tokens < row_buckets.BUCKET
        if tokens <= row_buckets.EXACT_UP_TO:
            assert rows == tokens
        else:
            assert rows % row_buckets.BUCKET == 0
    assert len({row_buckets.padded_rows(t) for t in range(1, 2049)}) <= row_buckets.EXACT_UP_TO + 2048 // 32


DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not native_bf16(torch.device("cpu")), reason="the CPU emulates bfloat16"))]


@pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32), reason="no oneDNN")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [129, 141, 200, 257])
def test_a_padded_step_gives_the_unpadded_hidden_states(monkeypatch, dtype, tokens):
    loaded = load_model(resolve_model("tiny"), dtype=dtype, kernels="onednn")
    assert row_buckets.padded_rows(tokens) > tokens
    ids = torch.randint(3, loaded.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        padded = loaded.model(ids, torch.arange(tokens))
        monkeypatch.setattr(qwen3, "padded_rows", lambda t: t)
        plain = loaded.model(ids, torch.arange(tokens))
    assert padded.shape == plain.shape == (tokens, loaded.config.hidden_size)
    torch.testing.assert_close(padded, plain, rtol=0, atol=0)


_EVERY_BUCKET_TWICE = """
import sys, torch
from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models import packed_gemv, row_buckets
from chatfleet.engine.models.loader import load_model
torch.set_num_threads(1)
loaded = load_model(resolve_model("tiny"), dtype=sys.argv[1], kernels="onednn")
counts = sorted({row_buckets.padded_rows(t) for t in range(1, 2049)})
with torch.inference_mode():
    for rows in counts:
        loaded.model(torch.ones(rows, dtype=torch.long), torch.arange(rows))
    print("=== second pass", flush=True)
    for rows in [c for c in counts if c > packed_gemv.MAX_ROWS][:8]:  # (fewer rows skip oneDNN)
        loaded.model(torch.ones(rows, dtype=torch.long), torch.arange(rows))
"""


def _second_pass_misses(env_capacity: str | None, dtype: str) -> int:
    """oneDNN's own report (ONEDNN_VERBOSE) of primitives built again when the first row counts
    come back after every other bucket ran once, in a fresh process."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in (ONEDNN_PRIMITIVE_CACHE, BOUND_MARK)}
    env["ONEDNN_VERBOSE"] = "profile_create"
    if env_capacity is not None:
        env[ONEDNN_PRIMITIVE_CACHE] = env_capacity
    out = subprocess.run([sys.executable, "-c", _EVERY_BUCKET_TWICE, dtype], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout
    first, _, second = out.partition("=== second pass")
    assert "create:cache_hit" in first  # the verbose report is there (8 layers share each shape)
    return second.count("create:cache_miss")


@pytest.mark.skipif(not onednn_available(torch.device("cpu"), torch.float32)
                    or runs_in_onednn(torch.float32, 48), reason="no oneDNN, or attention in oneDNN here")  # tiny: D 48
def test_every_bucket_stays_in_onednns_primitive_cache():
    assert _second_pass_misses(None, "float32") == 0  # the engine's reservation
    # A capacity the user set is kept: at native_caches' bound the first buckets' primitives go.
    assert _second_pass_misses(str(CACHE_ENTRIES), "float32") > 0


def test_the_reservation_keeps_a_capacity_the_user_set(monkeypatch):
    monkeypatch.setenv(ONEDNN_PRIMITIVE_CACHE, "64")
    monkeypatch.delenv(BOUND_MARK, raising=False)
    assert not row_buckets.reserve_primitive_cache()
    assert os.environ[ONEDNN_PRIMITIVE_CACHE] == "64"
