"""Logit bias, repetition / frequency / presence penalties and min-p against a per-row numpy
reference written from the documented semantics (OpenAI for frequency/presence/logit_bias,
HF/vLLM for repetition_penalty and min_p)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sampler import (
    Sampler,
    SamplingRow,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
)
from chatfleet.errors import InvalidRequestError

VOCAB = 40


def reference(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for t, b in p.logit_bias:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def random_rows(rng: np.random.Generator, n: int) -> list[SamplingRow]:
    rows = []
    for i in range(n):
        kind = i % 4
        params = SamplingParams(
            temperature=0.0,
            repetition_penalty=float(rng.uniform(0.5, 2.0)) if kind in (0, 1) else 1.0,
            frequency_penalty=float(rng.uniform(-2, 2)) if kind in (0, 2) else 0.0,
            presence_penalty=float(rng.uniform(-2, 2)) if kind in (0, 2) else 0.0,
            logit_bias=tuple((int(t), float(rng.uniform(-100, 100))) for t in rng.choice(VOCAB, 3, replace=False))
            if kind in (0, 3) else (),
        )
        prompt = [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(1, 12)))]
        output = [int(t) for t in rng.integers(0, VOCAB, int(rng.integers(0, 15)))]
        rows.append(SamplingRow(params, len(output), prompt_token_ids=prompt, output_token_ids=output))
    return rows


@pytest.mark.parametrize("seed", range(5))
def test_bias_and_penalties_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    rows = random_rows(rng, 9)
    logits = torch.from_numpy(rng.normal(0, 3, (len(rows), VOCAB)).astype(np.float32))
    want = np.stack([reference(logits[i].numpy(), r.params, list(r.prompt_token_ids), list(r.output_token_ids))
                     for i, r in enumerate(rows)])
    got = logits.clone()
    apply_logit_bias(got, rows)
    apply_penalties(got, rows)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)


def test_greedy_sampling_takes_the_argmax_after_bias_and_penalties():
    rng = np.random.default_rng(7)
    rows = random_rows(rng, 8)
    logits = torch.from_numpy(rng.normal(0, 3, (len(rows), VOCAB)).astype(np.float32))
    want = [int(np.argmax(reference(logits[i].numpy(), r.params, list(r.prompt_token_ids),
                                    list(r.output_token_ids)))) for i, r in enumerate(rows)]
    got = [s.token_id for s in Sampler().sample(logits.clone(), rows)]
    assert got == want


def test_rows_without_penalties_are_untouched():
    logits = torch.randn(3, VOCAB)
    rows = [SamplingRow(SamplingParams(), prompt_token_ids=[1, 2], output_token_ids=[3])] * 3
    got = logits.clone()
    apply_logit_bias(got, rows)
    apply_penalties(got, rows)
    assert torch.equal(got, logits)


def test_min_p_keeps_exactly_the_tokens_at_least_min_p_times_the_top():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, (4, VOCAB)).astype(np.float32)
    min_p = np.array([0.0, 0.05, 0.3, 1.0], dtype=np.float32)
    got = torch.from_numpy(logits.copy())
    apply_min_p(got, torch.from_numpy(min_p))
    for i in range(4):
        probs = np.exp(logits[i] - logits[i].max())
        probs /= probs.sum()
        keep = probs >= min_p[i] * probs.max()
        assert np.array_equal(np.isfinite(got[i].numpy()), keep)


def test_min_p_one_samples_the_top_token_at_any_temperature():
    logits = torch.randn(2, VOCAB)
    rows = [SamplingRow(SamplingParams(temperature=2.0, min_p=1.0, seed=s)) for s in (1, 2)]
    got = [t.token_id for t in Sampler(seed=5).sample(logits.clone(), rows)]
    assert got == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("kw", [{"repetition_penalty": 0.0}, {"presence_penalty": 3.0}, {"min_p": 1.5},
                                {"logit_bias": ((1, 101.0),)}, {"frequency_penalty": -2.5}])
def test_out_of_range_values_are_400_naming_the_parameter(kw):
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(**kw)
    assert ei.value.param == next(iter(kw))
