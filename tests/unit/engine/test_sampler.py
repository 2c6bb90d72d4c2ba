"""Sampler: greedy, temperature with top-k/top-p/min-p, per-request seeds independent of the
batch, penalties, logprobs."""

from __future__ import annotations

import torch

from seedance.engine.layers.sampler import Sampler, SamplingRow, apply_penalties
from seedance.engine.sampling_params import SamplingParams


def row(params: SamplingParams, tokens: list[int] | None = None, prompt: int = 0) -> SamplingRow:
    gen = None if params.seed is None else torch.Generator().manual_seed(params.seed)
    return SamplingRow(params, tokens or [], prompt, gen)


LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])


def test_greedy_picks_the_argmax():
    out = Sampler()(
        LOGITS.repeat(2, 1), [row(SamplingParams(temperature=0.0)), row(SamplingParams(top_k=1))]
    )
    assert out.token_ids == [1, 1]


def test_top_k_restricts_to_the_k_best():
    s = Sampler(seed=0)
    seen = {
        s(LOGITS, [row(SamplingParams(top_k=2, temperature=5.0))]).token_ids[0] for _ in range(200)
    }
    assert seen == {1, 2}


def test_top_p_keeps_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(seed=0)
    seen = {s(logits, [row(SamplingParams(top_p=0.7))]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7


def test_min_p_drops_unlikely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    s = Sampler(seed=0)
    seen = {s(logits, [row(SamplingParams(min_p=0.5))]).token_ids[0] for _ in range(300)}
    assert seen == {0, 1}  # p >= 0.25


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler(seed=1)
    draws = [s(logits, [row(SamplingParams())]).token_ids[0] for _ in range(2000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert abs(freq[0] - 0.7) < 0.05 and abs(freq[1] - 0.2) < 0.05


def test_a_seeded_row_does_not_depend_on_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    params = SamplingParams(seed=1234, temperature=1.0)
    r = row(params)
    alone = []
    for _ in range(5):
        alone.append(Sampler(seed=0)(logits[2:3], [r]).token_ids[0])
    r2 = row(params)
    crowd = []
    for step in range(5):
        rows = [row(SamplingParams(temperature=0.7)) for _ in range(6)]
        idx = (step * 7) % 6  # a different position and different neighbours each step
        rows[idx] = r2
        batch = logits.clone()
        batch[idx] = logits[2]
        crowd.append(Sampler(seed=step + 10)(batch, rows).token_ids[idx])
    assert crowd == alone


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_penalties(logits, row(SamplingParams(repetition_penalty=2.0), [0, 1]))
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, row(params, [3, 2, 2, 1], prompt=1))  # outputs: 2, 2, 1
    assert out.tolist() == [0.0, -0.75, -1.0, 0.0]


def test_penalty_changes_the_greedy_choice():
    out = Sampler()(
        LOGITS.clone(), [row(SamplingParams(temperature=0.0, repetition_penalty=10.0), [1])]
    )
    assert out.token_ids == [2]


def test_logprobs_of_chosen_and_top_n():
    out = Sampler()(LOGITS.clone(), [row(SamplingParams(temperature=0.0, logprobs=2))])
    lp = out.logprobs[0]
    expected = torch.log_softmax(LOGITS[0], -1)
    assert set(lp) == {1, 2}
    assert abs(lp[1] - float(expected[1])) < 1e-6
    none = Sampler()(LOGITS.clone(), [row(SamplingParams(temperature=0.0))])
    assert none.logprobs == [None]
