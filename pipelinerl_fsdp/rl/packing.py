"""Online sequence packing: sequences go into micro-batches under a token budget, several per row, no padding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipelinerl_fsdp.models.documents import Documents


def pack_into_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing: indices of `lengths` grouped into bins whose total length is <= budget.

    Every index appears in exactly one bin; within a bin, indices keep their original order.
    """
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the micro-batch budget trainer.micro_batch_tokens = {budget}"
            )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return [sorted(b) for b in bins]


@dataclass
class PackedRow:
    """Whole sequences packed into one row for next-token training: [1, T] tensors of the inputs, their positions
    (restarting per sequence), the targets and the sequence each target belongs to. A micro-batch is a PackedRow
    and the fields its loss reads (`rl.batching.RLMicroBatch`). `documents`: the row's sequences as spans and
    cumulative offsets, built on the host while packing, for the model's attention (None: the model derives them
    from `position_ids`, a device read). `logprob_index`: the flat indices of `logprob_positions()`'s nonzero
    entries, built on the host (`nonzero_index`; None: the model reads them from the mask, a device read)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    seq_index: torch.Tensor
    documents: Documents | None = field(default=None, kw_only=True)
    logprob_index: torch.Tensor | None = field(default=None, kw_only=True)

    def logprob_positions(self) -> torch.Tensor | None:
        """[1, T], nonzero on the targets whose log-probs the loss reads; None: every target."""
        return None


def pack_row(sequences: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> PackedRow:
    """Pack whole sequences into one row: sequences[i] has n_i tokens and contributes n_i - 1 (input, target)
    pairs."""
    ids, pos, tgt, seq = [], [], [], []
    for i, s in enumerate(sequences):
        if len(s) < 2:
            raise ValueError(f"sequence {i} has {len(s)} token(s); training needs at least 2")
        n = len(s) - 1
        ids.extend(s[:-1])
        tgt.extend(s[1:])
        pos.extend(range(n))
        seq.extend([i] * n)
    return PackedRow(
        *(torch.tensor(v, dtype=torch.long, device=device)[None] for v in (ids, pos, tgt, seq)),
        documents=Documents.from_lengths([[len(s) - 1 for s in sequences]], device),
    )


def per_target(
    sequences: Sequence[Sequence[int]], values: Sequence[Sequence[float]], name: str, device: torch.device | str
) -> torch.Tensor:
    """A per-token field aligned with `pack_row(sequences)`'s targets, [T] float32: values[i] has n_i - 1 values
    (e.g. a loss mask, behaviour log-probs, advantages)."""
    flat: list[float] = []
    for i, (s, vals) in enumerate(zip(sequences, values, strict=True)):
        if len(vals) != len(s) - 1:
            raise ValueError(f"per-token field {name!r} of sequence {i} has {len(vals)} values, expected {len(s) - 1}")
        flat.extend(vals)
    return torch.tensor(flat, dtype=torch.float32, device=device)


def nonzero_index(values: Sequence[float], device: torch.device | str) -> torch.Tensor:
    """The positions of the nonzero entries of a per-target field (e.g. the loss mask over a packed row's targets),
    int64 [n], built on the host: what `field.nonzero()` gives without reading the device back."""
    return torch.tensor([i for i, x in enumerate(values) if x], dtype=torch.long, device=device)
