"""A token's tenth of its completion (rl/positions.py), the one definition the lag, ESS and |log ratio| by position
share: floor(10 j / n) + 1 over the completion's model tokens."""

from __future__ import annotations

import random

import pytest
import torch

from pipelinerl_fsdp.rl.batching import completion_fields
from pipelinerl_fsdp.rl.positions import tenth
from pipelinerl_fsdp.samples import ENV_VERSION


def test_tenths_by_hand():
    assert [tenth(j, 10) for j in range(10)] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert [tenth(j, 20) for j in range(20)] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9, 10, 10]
    assert [tenth(j, 3) for j in range(3)] == [1, 4, 7]  # 0, 3.33, 6.67: a short completion leaves tenths empty
    assert [tenth(j, 1) for j in range(1)] == [1]
    # countdown's longest completion: 1,025 tokens; 10 x 102 / 1025 = 0.995, 10 x 103 / 1025 = 1.005
    assert (tenth(0, 1025), tenth(102, 1025), tenth(103, 1025), tenth(1024, 1025)) == (1, 1, 2, 10)
    for bad in ((-1, 5), (5, 5)):
        with pytest.raises(ValueError):
            tenth(*bad)


def test_every_tenth_holds_a_tenth_of_a_long_completion():
    n = 1000
    counts = [0] * 10
    for j in range(n):
        counts[tenth(j, n) - 1] += 1
    assert counts == [100] * 10


def completion_tenths(*completions: list[int]) -> list[list[int]]:
    """`completion_fields`' tenths of each completion (their versions), computed over all of them at once."""
    versions = torch.tensor([v for c in completions for v in c], dtype=torch.long)
    sample = torch.repeat_interleave(torch.arange(len(completions)), torch.tensor([len(c) for c in completions]))
    flat = completion_fields(versions, sample, len(completions), version=0)["tenth"].long().tolist()
    bounds = [0]
    for c in completions:
        bounds.append(bounds[-1] + len(c))
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def test_environment_tokens_have_no_tenth_and_do_not_count_in_n():
    e = ENV_VERSION
    # 5 model tokens around 2 environment tokens: j = 0..4 of n = 5 -> tenths 1, 3, 5, 7, 9
    assert completion_tenths([4, 4, e, e, 5, 5, 5], [7, 7, 7], []) == [[1, 3, 0, 0, 5, 7, 9], [1, 4, 7], []]


def test_the_batch_tenths_are_each_completions_own():
    """Completions of every length side by side, environment runs among them: each token's tenth is `tenth(j, n)`
    of its own completion's model tokens (j its index among them)."""
    rng = random.Random(0)
    completions = [[rng.choice([ENV_VERSION, 3, 4]) for _ in range(rng.randint(0, 60))] for _ in range(40)]
    for c, got in zip(completions, completion_tenths(*completions)):
        n = sum(v != ENV_VERSION for v in c)
        model = iter(range(n))
        assert got == [0 if v == ENV_VERSION else tenth(next(model), n) for v in c]
