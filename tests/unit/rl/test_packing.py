"""Packing: bins respect the budget and cover every sequence once; a packed row aligns targets and fields."""

import random

import pytest
import torch

from pipelinerl_fsdp.models.documents import Documents
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


def _same_documents(a: Documents, b: Documents) -> None:
    assert a.spans == b.spans and a.max_len == b.max_len
    assert a.cu_seqlens is not None and b.cu_seqlens is not None
    assert a.cu_seqlens.dtype == b.cu_seqlens.dtype == torch.int32
    assert a.cu_seqlens.tolist() == b.cu_seqlens.tolist()


def test_the_packers_offsets_equal_those_the_positions_give():
    """The offsets the packer builds on the host are those `Documents.from_positions` reads back from the device:
    random packings under a budget (rows of several sequences, single-sequence rows, a row filled exactly)."""
    rng = random.Random(1)
    seen_single = seen_full = seen_several = False
    for _ in range(60):
        budget = rng.choice([16, 33, 64])
        seqs = [[rng.randrange(50) for _ in range(rng.randint(2, budget + 1))] for _ in range(rng.randint(1, 12))]
        for b in pack_into_bins([len(s) - 1 for s in seqs], budget):
            row = pack_row([seqs[i] for i in b])
            assert row.documents is not None
            _same_documents(row.documents, Documents.from_positions(row.position_ids))
            assert row.documents.cu_seqlens.tolist()[-1] == row.input_ids.shape[1]
            seen_single |= len(b) == 1
            seen_several |= len(b) > 1
            seen_full |= row.input_ids.shape[1] == budget
    assert seen_single and seen_several and seen_full


def test_offsets_of_several_rows_are_in_the_flattened_tokens():
    """B > 1: each row's spans start at 0, the offsets run on across rows (row r's tokens at r * T + column), and a
    document ending exactly at a row's end ends there, not in the next row."""
    rng = random.Random(2)
    for _ in range(40):
        t = rng.randint(1, 24)
        rows = []
        for _ in range(rng.randint(2, 4)):
            cuts = sorted(rng.sample(range(1, t), rng.randint(0, min(4, t - 1)))) if t > 1 else []
            rows.append([e - s for s, e in zip([0, *cuts], [*cuts, t])])
        pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in rows])
        docs = Documents.from_lengths(rows)
        _same_documents(docs, Documents.from_positions(pos))
        ends = [r * t + e for r, _, e in docs.spans]
        assert docs.cu_seqlens.tolist() == [0, *ends] and ends[-1] == len(rows) * t
        assert docs.max_len == max(n for row in rows for n in row)


def test_offsets_refuse_rows_of_different_lengths():
    with pytest.raises(ValueError, match="rows of one length"):
        Documents.from_lengths([[3, 2], [4]])
    with pytest.raises(ValueError, match=">= 1"):
        Documents.from_lengths([[3, 0]])
