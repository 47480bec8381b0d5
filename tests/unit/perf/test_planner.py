"""The planner's pieces (perf/planner.py, plan_performance.py): lengths from a quantile file, the splits it searches,
the trained state's GPU floor, the recommendation and how sure it is (cases built by hand), and the plan stage's
performance part on a small cluster."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from pipelinerl_fsdp.config import GPU_KINDS, ConfigError
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.perf import planner
from pipelinerl_fsdp.perf.spec import GPUS, H100_SXM, ModelShape


def test_the_config_knows_every_gpu_preset():
    assert set(GPU_KINDS) == set(GPUS)
    with pytest.raises(ConfigError, match="plan.gpu"):
        load_config(["--config", "math", "--plan.gpu=tpu"])


def test_lengths_from_quantiles_follow_the_file_and_the_budget(tmp_path: Path):
    f = tmp_path / "l.json"
    f.write_text(json.dumps({"quantiles": {"p10": 100, "p50": 500, "p90": 2000, "max": 8000}}))
    lengths = planner.quantile_lengths(f)
    v = np.array(lengths.values)
    assert abs(np.median(v) - 500) <= 1 and v.max() == 8000 and v.min() >= 1
    # the inverse CDF is linear between the knots: a tenth of the points at or below p10
    assert np.mean(v <= 100) == pytest.approx(0.1, abs=2e-3)
    cut = planner.quantile_lengths(f, budget=1000)
    # 1000 lies a third of the way from p50 (500) to p90 (2000): the share at or above it 1 - (0.5 + 0.4 / 3)
    assert max(cut.values) == 1000 and np.mean(np.array(cut.values) == 1000) == pytest.approx(
        1 - (0.5 + 0.4 / 3), abs=2e-3
    )


def test_splits_are_multiples_of_tp_and_leave_the_trainer_its_floor():
    s = planner.splits(64, 2, 8)
    assert s and all(e % 2 == 0 and 2 <= e <= 56 for e in s) and len(s) <= 5
    assert planner.splits(8, 1, 7) == [1]
    assert planner.splits(8, 4, 6) == []  # no engine of 4 GPUs fits beside 6 trainer GPUs


def test_the_trained_state_sets_a_floor_on_trainer_gpus():
    shape = ModelShape.flavour("qwen2.5-7b")
    # 20 bytes per parameter over 90% of 80 GiB: by hand, 7.6e9 x 20 / (72 x 2^30) -> 2 GPUs
    assert planner.min_trainer_gpus(shape, H100_SXM) == int(np.ceil(shape.params * 20 / (0.9 * 80 * 2**30)))


@dataclass
class R:
    samples_per_s: float


def choice(mode: str, rate: float) -> planner.Choice:
    return planner.Choice(mode, 1, 4, 4, R(rate))  # type: ignore[arg-type]


def test_the_recommendation_says_how_sure_it_is():
    central = {"pipeline": choice("pipeline", 300), "colocated": choice("colocated", 200)}
    moved = [{"pipeline": choice("pipeline", 250), "colocated": choice("colocated", 200)}]
    assert planner.recommend([central, *moved]) == ("pipeline", 1.5, "clear")
    close = [{"pipeline": choice("pipeline", 210), "colocated": choice("colocated", 200)}]
    assert planner.recommend([central, *close])[2] == "likely"
    lost = [{"pipeline": choice("pipeline", 190), "colocated": choice("colocated", 200)}]
    assert planner.recommend([central, *lost])[2] == "uncertain (colocated wins under some assumptions)"


def test_the_plan_stage_predicts_a_small_cluster():
    from pipelinerl_fsdp.plan_performance import performance_plan

    c = load_config(
        ["--config", "math", "--model.flavour=qwen2.5-0.5b", "--model.path=", "--plan.nodes=1",
         "--rl.batch_size=256", "--world.inference_ranks=3", "--task.max_new_tokens=2048"]
    )  # fmt: skip
    text = performance_plan(c.plan, c.model, c.rl, c.inference, c.task, c.trainer, c.world.inference_ranks)
    assert "| this job's | pipeline | 3 / 5 |" in text
    for mode in ("best split | pipeline", "best split | async", "best split | conventional", "in turn | colocated"):
        assert mode in text
    assert "recommendation: " in text and "math_reasoning_lengths.json" in text
