"""The memory plan's formulas against peak host memory measured on CPU for scaled-down shapes
(`python -m benchmarks.memory_vs_plan --quick`): sharded load on 2 ranks from a 4-shard folder, a step with and without
activation checkpointing, attention over a packed 8k-token row, and both sides of the weight sync."""

from __future__ import annotations

import pytest

from benchmarks import memory_vs_plan


@pytest.mark.slow
def test_measured_peak_memory_is_within_15_percent_of_the_plan():
    rows = memory_vs_plan.measure(quick=True)
    items = [r["item"] for r in rows]
    assert sum(i.startswith("load, rank") for i in items) == 2 and any("checkpointing full" in i for i in items)
    # Measured over 5 runs (the note of this change): ratios 0.89-1.02, identical to 0.01 between runs.
    off = [r for r in rows if not 0.85 <= r["ratio"] <= 1.15]
    assert not off, "\n".join(f"{r['item']}: plan {r['plan_mb']:.1f} MB, measured {r['measured_mb']:.1f}" for r in off)
    # checkpointing must show in the measurement, not only in the plan
    step = {("full" if "full" in r["item"] else "off"): r["measured_mb"] for r in rows if r["item"].startswith("step")}
    assert step["full"] < 0.5 * step["off"], step
