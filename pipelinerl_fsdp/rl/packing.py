"""Online sequence packing: sequences go into micro-batches under a token budget, several per row, no padding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


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


def collate_packed(
    sequences: Sequence[Sequence[int]],
    per_token: Mapping[str, Sequence[Sequence[float]]] | None = None,
    device: torch.device | str = "cpu",
) -> dict[str, torch.Tensor]:
    """Pack whole sequences into one row for next-token training.

    sequences[i] has n_i tokens and contributes n_i - 1 (input, target) pairs; per_token[name][i] has n_i - 1
    values aligned with those targets (e.g. a loss mask, behaviour log-probs, advantages).
    Returns [1, T] tensors: input_ids, position_ids (restarting per sequence), targets, and each per-token
    field as float32, plus `seq_index` (which sequence each target belongs to).
    """
    per_token = per_token or {}
    ids, pos, tgt, seq = [], [], [], []
    fields: dict[str, list[float]] = {k: [] for k in per_token}
    for i, s in enumerate(sequences):
        if len(s) < 2:
            raise ValueError(f"sequence {i} has {len(s)} token(s); training needs at least 2")
        n = len(s) - 1
        ids.extend(s[:-1])
        tgt.extend(s[1:])
        pos.extend(range(n))
        seq.extend([i] * n)
        for k, vals in per_token.items():
            if len(vals[i]) != n:
                raise ValueError(f"per-token field {k!r} of sequence {i} has {len(vals[i])} values, expected {n}")
            fields[k].extend(vals[i])
    out = {
        "input_ids": torch.tensor(ids, dtype=torch.long, device=device)[None],
        "position_ids": torch.tensor(pos, dtype=torch.long, device=device)[None],
        "targets": torch.tensor(tgt, dtype=torch.long, device=device)[None],
        "seq_index": torch.tensor(seq, dtype=torch.long, device=device)[None],
    }
    for k, vals in fields.items():
        out[k] = torch.tensor(vals, dtype=torch.float32, device=device)[None]
    return out
