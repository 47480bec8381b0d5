"""Records whose fields say how they combine (records.py): the engines' counters and the loss statistics are
combined, flattened and reduced over ranks from their fields alone, each field with its reduction."""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from pipelinerl_fsdp.records import MAX, SUM, combine, from_values, positions, reduction, stat, total, values
from pipelinerl_fsdp.rl.loss import POSITION_BINS, TURN_BINS, LossStats
from pipelinerl_fsdp.rl.positions import TENTHS
from pipelinerl_fsdp.samples import EngineStats
from pipelinerl_fsdp.training import train_step


@dataclasses.dataclass
class Counts:
    n: float = stat(SUM)
    longest: float = stat(MAX)
    bins: tuple[float, ...] = stat(SUM, size=2)


def test_a_field_starts_at_its_reductions_identity_and_combines_with_it():
    assert Counts() == Counts(0.0, -math.inf, (0.0, 0.0))
    a, b = Counts(1.0, 3.0, (1.0, 2.0)), Counts(2.5, -1.0, (0.5, 0.0))
    assert combine(a, b) == Counts(3.5, 3.0, (1.5, 2.0))
    assert total([a, b], Counts()) == combine(a, b) and total([], Counts()) == Counts()
    with pytest.raises(ValueError, match="unknown reduction"):
        stat("mean")


def test_values_spread_tuples_in_field_order_and_come_back():
    c = Counts(1.0, 3.0, (4.0, 5.0))
    assert values(c) == [1.0, 3.0, 4.0, 5.0]
    assert values(c, SUM) == [1.0, 4.0, 5.0] and values(c, MAX) == [3.0]
    assert from_values(Counts(), [1.0, 3.0, 4.0, 5.0]) == c
    assert from_values(c, [7.0], MAX) == Counts(1.0, 7.0, (4.0, 5.0))  # the other fields kept
    with pytest.raises(ValueError, match="3 values for the 4"):
        from_values(Counts(), [1.0, 2.0, 3.0])
    assert positions(Counts, SUM) == [0, 2, 3] and positions(Counts, MAX) == [1]


def test_the_job_records_declare_a_reduction_for_every_field():
    engine = {f.name: reduction(f) for f in dataclasses.fields(EngineStats)}
    assert engine.pop("pause_ms_max") == MAX and set(engine.values()) == {SUM}  # summed over the engines
    assert EngineStats().pause_ms_max == 0.0  # a pause is never negative: none yet is 0, as before
    loss = {f.name: reduction(f) for f in dataclasses.fields(LossStats)}
    assert loss.pop("max_log_ratio") == MAX and set(loss.values()) == {SUM}
    # 19 scalars, 9 tuples
    assert len(values(LossStats())) == 19 + 2 * len(POSITION_BINS) + 3 * TURN_BINS + 4 * TENTHS


def test_reduce_over_ranks_is_one_all_reduce_per_reduction_and_combines_like_the_fields_say():
    """Two ranks, the other's record given: every field reduced as `combine` would."""
    mine = LossStats(tokens=3.0, sum_rho=2.5, max_log_ratio=0.25, turn_tokens=(1.0,) * TURN_BINS)
    other = LossStats(
        tokens=4.0,
        sum_rho=1.0,
        max_log_ratio=1.5,
        lag0_k3_pos=(0.5,) * len(POSITION_BINS),
        tenth_rho2=tuple(float(i) for i in range(TENTHS)),
    )
    ops = []

    def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
        kind = SUM if op == dist.ReduceOp.SUM else MAX
        ops.append(kind)
        # the other rank sends the same vector: its values of this reduction, the identity elsewhere
        full = torch.tensor(values(other), dtype=t.dtype)
        theirs = torch.full_like(full, 0.0 if kind == SUM else -math.inf)
        theirs[positions(LossStats, kind)] = full[positions(LossStats, kind)]
        t.copy_(t + theirs if kind == SUM else torch.maximum(t, theirs))

    with mock.patch.object(train_step.dist, "all_reduce", all_reduce):
        reduced = train_step.reduce_over_ranks(mine, None, torch.device("cpu"))
    assert sorted(ops) == [MAX, SUM]
    assert reduced == combine(mine, other)
    assert reduced.max_log_ratio == 1.5 and reduced.tokens == 7.0 and reduced.turn_tokens[0] == 1.0
    assert reduced.tenth_rho2 == tuple(float(i) for i in range(TENTHS))  # the tenth sums too, element by element
