"""Packing: bins respect the budget and cover every sequence once; a packed row aligns targets and fields."""

import random

import pytest
import torch

from pipelinerl_fsdp.rl.packing import pack_into_bins, pack_row, per_target


def test_bins_cover_each_sequence_once_under_budget():
    rng = random.Random(0)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 30))]
        bins = pack_into_bins(lengths, 64)
        flat = sorted(i for b in bins for i in b)
        assert flat == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
        # first-fit-decreasing never needs more than 11/9 OPT + 1 bins; OPT >= total / budget
        assert len(bins) <= 11 / 9 * (sum(lengths) / 64 + 1) + 1


def test_too_long_sequence_names_the_key():
    with pytest.raises(ValueError, match="trainer.micro_batch_tokens"):
        pack_into_bins([5, 100], 64)


def test_collate_shapes_positions_and_fields():
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    mask = [[0.0, 1.0], [1.0], [0.0, 1.0, 1.0]]
    out = pack_row(seqs)
    assert out.input_ids.tolist() == [[1, 2, 4, 6, 7, 8]]
    assert out.targets.tolist() == [[2, 3, 5, 7, 8, 9]]
    assert out.position_ids.tolist() == [[0, 1, 0, 0, 1, 2]]
    assert out.seq_index.tolist() == [[0, 0, 1, 2, 2, 2]]
    loss_mask = per_target(seqs, mask, "loss_mask", "cpu")
    assert loss_mask.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert loss_mask.dtype == torch.float32


def test_collate_rejects_misaligned_field():
    with pytest.raises(ValueError, match="loss_mask"):
        per_target([[1, 2, 3]], [[1.0]], "loss_mask", "cpu")
