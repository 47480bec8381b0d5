"""Rollout messages: ragged batches survive the tensor encoding exactly."""

import random

import pytest
import torch

from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.transport.rollouts import decode_samples, encode_samples


def test_ragged_roundtrip():
    rng = random.Random(0)
    samples = []
    for g in range(5):
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(0, 30)
            samples.append(
                Sample(
                    g,
                    [rng.randint(0, 99) for _ in range(rng.randint(1, 20))],
                    [rng.randint(0, 99) for _ in range(n)],
                    [-rng.random() for _ in range(n)],
                    [rng.randint(0, 7) for _ in range(n)],
                    float(rng.randint(0, 1)),
                    rng.random() - 0.5,
                    rng.random() < 0.5,
                )
            )
    ints, floats = encode_samples(samples)
    back = decode_samples(len(samples), ints, floats)
    for a, b in zip(samples, back):
        assert (a.group_id, a.prompt_ids, a.completion_ids, a.versions, a.finished) == (
            b.group_id,
            b.prompt_ids,
            b.completion_ids,
            b.versions,
            b.finished,
        )
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-7)  # float32 on the wire
        assert b.reward == a.reward and b.advantage == pytest.approx(a.advantage, abs=1e-7)


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError, match="differ in length"):
        encode_samples([Sample(0, [1], [2, 3], [-0.1], [0, 0], 1.0)])


def test_corrupt_payload_detected():
    ints, floats = encode_samples([Sample(0, [1], [2], [-0.1], [0], 1.0)])
    with pytest.raises(RuntimeError, match="corrupt"):
        decode_samples(1, ints, torch.cat([floats, torch.zeros(1)]))
