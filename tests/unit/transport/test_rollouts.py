"""Rollout messages: ragged batches survive the tensor encoding exactly, with the sender's counters."""

import dataclasses
import random

import pytest
import torch

from pipelinerl_fsdp.records import values
from pipelinerl_fsdp.samples import EngineStats, EvalReport, Sample
from pipelinerl_fsdp.transport.rollouts import (
    DATA,
    EVAL,
    decode_message,
    decode_samples,
    encode_message,
    encode_samples,
)


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


def test_every_engine_counter_travels_with_a_group_and_with_an_evaluation_report():
    # a distinct value per field: a counter left out, or two swapped, would show
    stats = EngineStats(*(float(i) + 0.5 for i in range(len(dataclasses.fields(EngineStats)))))
    group = [Sample(3, [1, 2], [5, 6], [-0.25, -0.5], [1, 1], 1.0, 0.5)]
    header, ints, floats = encode_message(group, values(stats))
    kind, n, n_ints, n_floats = header.tolist()
    assert (kind, n, n_ints, n_floats) == (DATA, 1, ints.numel(), floats.numel())
    back, back_stats = decode_message(kind, n, ints, floats)
    assert back_stats == stats and back[0].completion_ids == [5, 6] and back[0].advantage == 0.5
    report = EvalReport(1, 7, 4, [0, 5], [2, 4])
    header, ints, floats = encode_message(report, values(stats))
    assert header[0] == EVAL
    assert decode_message(EVAL, int(header[1]), ints, floats) == (report, stats)
