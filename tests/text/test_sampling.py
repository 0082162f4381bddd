"""Sampler against the math: argmax when greedy, softmax(logits / T) renormalised over the
top-k / top-p set when sampling; seeds reproduce; bad parameters name their field."""

from __future__ import annotations

import pytest
import torch

from sharktank.text import Sampler, SamplingParams

LOGITS = torch.tensor([2.0, 1.5, 0.3, -1.0, 0.9])


def frequencies(params: SamplingParams, logits: torch.Tensor, n: int = 20000) -> torch.Tensor:
    s = Sampler(params)
    draws = torch.tensor([s.next_token(logits) for _ in range(n)])
    return torch.bincount(draws, minlength=logits.numel()).float() / n


def test_greedy_is_argmax():
    g = torch.Generator().manual_seed(1)
    s = Sampler(SamplingParams())
    for _ in range(50):
        row = torch.randn(300, generator=g)
        assert s.next_token(row) == int(torch.argmax(row))
    assert s.next_token(torch.tensor([0.0, 3.0, 1.0], dtype=torch.bfloat16)) == 1


def test_the_same_seed_draws_the_same_tokens_and_another_seed_does_not():
    row = torch.zeros(50)
    a = Sampler(SamplingParams(temperature=1.0, seed=7))
    b = Sampler(SamplingParams(temperature=1.0, seed=7))
    c = Sampler(SamplingParams(temperature=1.0, seed=8))
    seq_a, seq_b, seq_c = ([s.next_token(row) for _ in range(40)] for s in (a, b, c))
    assert seq_a == seq_b and seq_a != seq_c
    assert len(set(seq_a)) > 10  # uniform over 50: really random, not a constant


def test_top_k_one_and_a_tiny_top_p_are_argmax():
    g = torch.Generator().manual_seed(2)
    for params in (SamplingParams(temperature=1.5, top_k=1, seed=0), SamplingParams(temperature=1.5, top_p=1e-6, seed=0)):
        s = Sampler(params)
        for _ in range(30):
            row = torch.randn(100, generator=g)
            assert s.next_token(row) == int(torch.argmax(row))


@pytest.mark.parametrize(
    "params, want",
    [
        (SamplingParams(temperature=1.0, seed=0), torch.softmax(LOGITS, 0)),
        (SamplingParams(temperature=2.0, seed=1), torch.softmax(LOGITS / 2, 0)),
        # top_k=2 keeps tokens 0 and 1, renormalised.
        (SamplingParams(temperature=1.0, top_k=2, seed=2), torch.softmax(torch.tensor([2.0, 1.5, -1e9, -1e9, -1e9]), 0)),
    ],
    ids=["T1", "T2", "top_k2"],
)
def test_sampled_frequencies_match_the_distribution(params, want):
    # 20000 draws: each frequency's standard error is at most 0.0036; 0.015 is four of them.
    got = frequencies(params, LOGITS)
    assert (got - want).abs().max() < 0.015, (got, want)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: tokens 0 and 1, renormalised to 0.625 / 0.375.
    got = frequencies(SamplingParams(temperature=1.0, top_p=0.7, seed=3), probs.log())
    assert (got - torch.tensor([0.625, 0.375, 0.0, 0.0])).abs().max() < 0.015, got


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 0), ("max_tokens", 2.0), ("temperature", -0.1), ("temperature", True), ("top_k", -1),
     ("top_p", 0.0), ("top_p", 1.5), ("seed", -3), ("seed", "1")],
)
def test_invalid_params_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} must be .*found {value!r}"):
        SamplingParams(**{field: value})


def test_next_token_takes_one_row():
    with pytest.raises(ValueError, match=r"one \[vocab\] row of logits, found shape \[2, 5\]"):
        Sampler(SamplingParams()).next_token(torch.zeros(2, 5))
