"""Row buckets: the padded row count, and that padding rows never reach the step's tokens (the
model's output over a bucketed step equals the unpadded one's)."""

from __future__ import annotations

import pytest
import torch

from chatfleet.engine.builtin_models.tiny import resolve_model
from chatfleet.engine.models import qwen3, row_buckets
from chatfleet.engine.models.dtype import native_bf16
from chatfleet.engine.models.linear import onednn_available
from chatfleet.engine.models.loader import load_model


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
@pytest.mark.parametrize("tokens", [33, 45, 100, 257])
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
