"""Sampler: greedy, seeded reproducibility independent of the batch, top-k/top-p, masks, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chatfleet.engine.request import SamplingParams
from chatfleet.engine.runner.sampler import Sampler, SamplingRow, first_max, inverse_cdf_draw

V = 512
EOS, END = 7, 3  # the row's eos, and another end-of-turn token of the model


def _logits(n=6, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = _logits()
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 6
    out = Sampler().sample(logits.clone(), rows)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert all(t.logprob is None for t in out)


def test_first_max_is_argmax_with_ties_and_nans():
    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        ties = torch.randint(0, 3, (64, 7190), generator=gen).to(dtype)  # many tied maxima per row
        ties[3, 100] = ties[3, 50] = float("nan")
        ties[4] = float("-inf")
        assert torch.equal(first_max(ties), ties.argmax(dim=-1))
    assert first_max(torch.tensor([[0.0, 2.0, 2.0, float("nan"), float("nan")]])).tolist() == [3]


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits()
    for params in (SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=1.3, top_p=1e-6)):
        out = Sampler(seed=5).sample(logits.clone(), [SamplingRow(params)] * 6)
        assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = _logits(8)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [Sampler(seed=0).sample(logits[3:4].clone(), [SamplingRow(params, generator=_gen(42))])[0].token_id
             for _ in range(2)]
    assert alone[0] == alone[1]
    # Same row inside a batch of other rows (seeded and not), at another index, another sampler seed.
    others = [SamplingRow(SamplingParams(temperature=0.7)), SamplingRow(SamplingParams(temperature=1.0, seed=1),
                                                                         generator=_gen(1))]
    batch = torch.cat([logits[:2], logits[3:4], logits[4:]])
    rows = others + [SamplingRow(params, generator=_gen(42))] + [others[0]] * 4
    assert Sampler(seed=99).sample(batch.clone(), rows)[2].token_id == alone[0]


def test_seeded_sequence_follows_the_generator():
    logits = _logits(1)
    gen_a, gen_b = _gen(7), _gen(7)
    row = SamplingParams(temperature=1.0, seed=7)
    seq_a = [Sampler().sample(logits.clone(), [SamplingRow(row, generator=gen_a)])[0].token_id for _ in range(20)]
    seq_b = [Sampler(seed=3).sample(logits.clone(), [SamplingRow(row, generator=gen_b)])[0].token_id for _ in range(20)]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 1  # it really samples


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2] + [0.0] * (V - 3))
    logits = probs.clamp_min(1e-30).log().repeat(4000, 1)
    rows = [SamplingRow(SamplingParams(temperature=1.0))] * 4000
    tokens = torch.tensor([t.token_id for t in Sampler(seed=1).sample(logits, rows)])
    freq = torch.bincount(tokens, minlength=V)[:3].float() / 4000
    assert torch.allclose(freq, probs[:3], atol=0.04)
    assert int(tokens.max()) <= 2


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0] + [-10.0] * (V - 5)]).repeat(500, 1)
    top2 = Sampler(seed=1).sample(logits.clone(), [SamplingRow(SamplingParams(temperature=2.0, top_k=2))] * 500)
    assert {t.token_id for t in top2} == {0, 1}
    # softmax([4,3,2,...]) ~ [.64, .24, .09, ...]: top_p=0.8 keeps tokens 0 and 1.
    nucleus = Sampler(seed=1).sample(logits.clone(), [SamplingRow(SamplingParams(temperature=1.0, top_p=0.8))] * 500)
    assert {t.token_id for t in nucleus} == {0, 1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_ids(temperature):
    logits = torch.full((1, V), -5.0)
    logits[0, [EOS, END, 11]] = torch.tensor([10.0, 9.0, 8.0])
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=(11,), max_tokens=10)
    sampler = Sampler(stop_token_ids=(END,), seed=0)
    early = sampler.sample(logits.clone(), [SamplingRow(params, num_output_tokens=2, eos_token_id=EOS)])
    assert early[0].token_id not in (EOS, END, 11)
    late = sampler.sample(logits.clone(), [SamplingRow(params, num_output_tokens=3, eos_token_id=EOS)])
    assert late[0].token_id == EOS or temperature > 0


def test_ignore_eos_masks_eos_always():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS], logits[0, END] = 10.0, 9.0
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    out = Sampler(stop_token_ids=(END,)).sample(logits.clone(), [SamplingRow(params, 50, eos_token_id=EOS)])
    assert out[0].token_id not in (EOS, END)


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = _logits(3)
    raw = logits.log_softmax(-1)
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, logprobs=0)),
        SamplingRow(SamplingParams(temperature=0.5, top_k=5, logprobs=4), generator=_gen(1)),
        SamplingRow(SamplingParams(temperature=0.0)),
    ]
    out = Sampler().sample(logits.clone(), rows)
    for i in (0, 1):
        lp = out[i].logprob
        assert lp is not None and lp.token_id == out[i].token_id
        assert lp.logprob == pytest.approx(raw[i, out[i].token_id].item(), abs=1e-5)
    assert out[0].logprob.top == []
    top = out[1].logprob.top
    assert [t for t, _ in top] == raw[1].topk(4).indices.tolist()
    assert [v for _, v in top] == pytest.approx(raw[1].topk(4).values.tolist(), abs=1e-5)
    assert out[2].logprob is None


def test_inverse_cdf_draw_picks_the_token_whose_interval_holds_u():
    # oracle: numpy's float64 cumulative sum of the softmax, and the first sum above u * total
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 300, generator=gen) * 4
    logits[:, ::7] = float("-inf")  # masked tokens: never drawn
    u = torch.rand(64, generator=gen)
    u[0], u[1] = 0.0, 1.0 - 2.0**-24  # the interval's two ends
    got = inverse_cdf_draw(logits.clone(), u)
    for i in range(64):
        row = logits[i].numpy()
        p = (logits[i] - logits[i].max()).exp().numpy()
        cdf = np.cumsum(p.astype(np.float64)).astype(np.float32)  # torch's CPU cumsum sums in float64
        want = int(np.searchsorted(cdf, np.float32(u[i].item()) * cdf[-1], side="right"))
        want = min(want, int(np.flatnonzero(p > 0).max()))
        assert int(got[i]) == want
        assert np.isfinite(row[int(got[i])])


def test_inverse_cdf_draw_where_u_times_the_total_reaches_the_total_takes_the_last_token_with_a_share():
    # u = 1 stands for a u just below 1 whose product with the total rounds up to it
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), float("-inf")], [3.0, float("-inf"), 0.0, 0.0, 1.0]])
    assert inverse_cdf_draw(logits.clone(), torch.tensor([1.0, 1.0])).tolist() == [2, 4]


def test_inverse_cdf_draw_of_a_row_without_a_finite_logit_takes_its_first_max():
    logits = torch.tensor([[float("-inf")] * 5, [0.0, float("nan"), 1.0, 2.0, 0.0], [0.0, 5.0, 0.0, 0.0, 0.0]])
    got = inverse_cdf_draw(logits.clone(), torch.tensor([0.3, 0.3, 0.5]))
    assert got.tolist() == [0, 1, 1]
