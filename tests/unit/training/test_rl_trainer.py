"""`RLTrainer` over fake collaborators (one trainer rank, a one-rank gloo group): which batches its step gets, the
versions it pushes, what it logs, when it checkpoints and exports, how it stops, and how it resumes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pipelinerl_fsdp.config import CheckpointConfig, LossConfig, MetricsConfig, RLConfig, TrainerConfig
from pipelinerl_fsdp.job.world import World
from pipelinerl_fsdp.rl.advantages import group_advantages
from pipelinerl_fsdp.rl.loss import LossStats
from pipelinerl_fsdp.samples import EngineStats, Sample
from pipelinerl_fsdp.tasks import make_task
from pipelinerl_fsdp.tasks.arithmetic import AdditionConfig
from pipelinerl_fsdp.training.collector import Collector
from pipelinerl_fsdp.training.evaluation import EvalAggregator
from pipelinerl_fsdp.training.rl_trainer import RLTrainer, TrainerParts

# what an engine reports with every group (inference/worker.py's counters)
ENGINE_STATS = EngineStats(gen_tokens=10.0, busy_s=1.0, elapsed_s=1.0, seq_s=1.0)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield World(0, 2, 0, 2, torch.device("cpu"), "gloo", [0], [1], None, None, None, None)
    dist.destroy_process_group()


def group(gid: int, version: int, rewards: tuple[float, float] = (0.0, 1.0)) -> list[Sample]:
    """A finished group of two attempts sampled by `version`."""
    advs = group_advantages(list(rewards))
    return [Sample(gid, [1, 2], [3, 4, 5], [-0.5] * 3, [version] * 3, r, a) for r, a in zip(rewards, advs)]


class FakeReceiver:
    """The rollout receiver: prepared groups, in order, then nothing."""

    def __init__(self, groups: list[list[Sample]]) -> None:
        self.groups, self.drained = list(groups), False

    def get(self, timeout: float):
        return (0, self.groups.pop(0), dataclasses.replace(ENGINE_STATS)) if self.groups else None

    def qsize(self) -> int:
        return len(self.groups)

    def finished(self) -> bool:
        return not self.groups

    def drain(self) -> None:
        self.drained = True


class FakeStep:
    """The RL step: records what it trained on; returns the given gradient norms in turn."""

    def __init__(self, norms: list[float]) -> None:
        self.norms = iter(norms)
        self.calls: list[tuple[int, list[list[int]], list[float]]] = []  # (version, group ids per part, weights)

    def run(self, parts, n_parts, version, before_update=None):
        it = iter(parts)
        taken = [next(it) for _ in range(n_parts)]
        weights = [s.loss_weight for part in taken for s in part]
        self.calls.append((version, [[s.group_id for s in part] for part in taken], weights))
        sums = LossStats()  # reduced over the ranks, as RLStep returns them
        if before_update is not None:
            before_update(sums)
        return sums, next(self.norms)


class FakePusher:
    def __init__(self) -> None:
        self.pushed: list[int] = []
        self.finished = 0
        self.stopped = False

    def push(self, version: int, wait: bool = True):
        self.pushed.append(version)
        return None

    def finish(self):
        self.finished += 1
        return None

    def stop(self) -> None:
        self.stopped = True


class FakeLogger:
    def __init__(self) -> None:
        self.records: list[tuple[int, dict, bool]] = []
        self.closed = False

    def log(self, step: int, values: dict, console: bool = True, evals=()) -> None:
        self.records.append((step, values, console))

    def log_text(self, step: int, tag: str, text: str) -> None:
        raise AssertionError("no rollouts in TensorBoard here")

    def close(self) -> None:
        self.closed = True


class FakeCheckpointer:
    def __init__(self) -> None:
        self.saved: list[tuple[int, dict]] = []

    def save(self, step: int, meta: dict) -> None:
        self.saved.append((step, dict(meta)))


class FakeExporter:
    def __init__(self) -> None:
        self.exported: list[int | None] = []

    def export(self, step: int | None) -> None:
        self.exported.append(step)


def make_trainer(
    world: World,
    groups: list[list[Sample]],
    norms: list[float],
    resumed: dict | None = None,
    interval: int = 2,
    export_every: int = 2,
    **rl_keys,
) -> tuple[RLTrainer, SimpleNamespace]:
    rl = RLConfig(**{"attempts": 2, "batch_size": 4, "max_steps": 5, "max_lag": 2, "check_mismatch": 0.0, **rl_keys})
    receiver = FakeReceiver(groups)
    fakes = SimpleNamespace(
        receiver=receiver,
        step=FakeStep(norms),
        pusher=FakePusher(),
        logger=FakeLogger(),
        checkpointer=FakeCheckpointer(),
        exporter=FakeExporter(),
    )
    policy = SimpleNamespace(lr=1e-3, model=torch.nn.Linear(2, 2))
    parts = TrainerParts(
        world,
        make_task(AdditionConfig(digits=1)),
        policy,
        fakes.step,
        fakes.pusher,
        Collector(receiver, rl, n_engines=1),
        receiver,
        fakes.logger,
        SimpleNamespace(due=lambda step: False),
        EvalAggregator([], 1, [1]),
        fakes.checkpointer,
        fakes.exporter,
    )
    trainer = RLTrainer(
        rl,
        TrainerConfig(max_nonfinite_steps=3),
        LossConfig(),
        MetricsConfig(log_every=2, tensorboard=False),
        CheckpointConfig(interval=interval, export_every=export_every),
        0,
        16,
        64,
        5.0,
        parts,
        resumed,
    )
    return trainer, fakes


def test_it_trains_every_step_on_the_collected_groups_pushes_each_version_and_logs_checkpoints_exports(world):
    # two groups per step, each sampled by the version the trainer is at; a stale group (version 0 at step 4,
    # rl.max_lag 2) arrives among step 4's and is dropped whole
    groups = [group(2 * k + i, k) for k in range(4) for i in range(2)]
    groups += [group(100, 0), group(8, 4), group(9, 4)]
    trainer, f = make_trainer(world, groups, norms=[1.0, 2.0, 3.0, 4.0, 5.0])
    trainer.run()
    assert [(v, ids) for v, ids, _ in f.step.calls] == [
        (0, [[0, 0, 1, 1]]),
        (1, [[2, 2, 3, 3]]),
        (2, [[4, 4, 5, 5]]),
        (3, [[6, 6, 7, 7]]),
        (4, [[8, 8, 9, 9]]),
    ]
    assert all(w > 0 for _, _, weights in f.step.calls for w in weights)  # loss weights assigned before the step
    assert f.pusher.pushed == [1, 2, 3, 4, 5] and f.pusher.finished == 5
    steps = [step for step, _, _ in f.logger.records]
    assert steps == [1, 2, 3, 4, 5]
    values = [v for _, v, _ in f.logger.records]
    assert [v["version"] for v in values] == [1, 2, 3, 4, 5]
    assert [v["samples"] for v in values] == [4, 8, 12, 16, 20]
    assert [v["grad_norm"] for v in values] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert [v["dropped_stale"] for v in values] == [0, 0, 0, 0, 2]
    assert values[-1]["dropped_stale_groups"] == 1 and values[-1]["skipped_nonfinite_steps"] == 0
    # the console line: the first step, every metrics.log_every, the last
    assert [console for _, _, console in f.logger.records] == [True, True, False, True, True]
    # checkpoints every checkpoint.interval steps and at the end, with the version and the collector's state
    assert [step for step, _ in f.checkpointer.saved] == [2, 4, 5]
    assert [meta["version"] for _, meta in f.checkpointer.saved] == [2, 4, 5]
    last_meta = f.checkpointer.saved[-1][1]
    assert last_meta["dropped_stale"] == 2 and last_meta["stream_next"] == {"0": 101}
    assert f.exporter.exported == [2, 4, None]  # periodic exports before the last step, then final/
    assert f.pusher.stopped and f.receiver.drained and f.logger.closed


def test_a_non_finite_step_keeps_the_version_and_too_many_in_a_row_stop_the_run(world):
    groups = [group(i, 0) for i in range(40)]
    nan = float("nan")
    trainer, f = make_trainer(world, groups, [1.0, nan, 1.0, 1.0, nan, nan, nan], max_steps=10, sync_every=2, max_lag=9)
    with pytest.raises(FloatingPointError, match="non-finite loss or gradient in 3 steps in a row"):
        trainer.run()
    assert [v for v, _, _ in f.step.calls] == [0, 1, 1, 2, 3, 3, 3]
    assert f.pusher.pushed == [2]  # rl.sync_every = 2: only version 2 was due
    values = [v for _, v, _ in f.logger.records]
    assert [v["version"] for v in values] == [1, 1, 2, 3, 3, 3]
    assert [v["skipped_nonfinite_steps"] for v in values] == [0, 1, 1, 1, 2, 3]
    assert math.isnan(values[1]["grad_norm"])
    # the steps done before the failure were checkpointed and exported; no final export, the engines not told
    assert [step for step, _ in f.checkpointer.saved] == [2, 4, 6] and f.exporter.exported == [2, 4, 6]
    assert not f.pusher.stopped


def test_a_step_in_parts_takes_each_part_from_the_collector_in_turn(world):
    trainer, f = make_trainer(world, [group(i, 0) for i in range(4)], [1.0, 1.0], max_steps=2, waves=2)
    trainer.run()
    assert [(v, ids) for v, ids, _ in f.step.calls] == [(0, [[0, 0], [1, 1]]), (1, [[2, 2], [3, 3]])]


def test_a_resumed_trainer_pushes_the_restored_version_first_and_continues_its_steps_and_counts(world):
    resumed = {"step": 3, "version": 3, "dropped_stale": 6, "dropped_stale_groups": 3, "stream_next": {"0": 20}}
    trainer, f = make_trainer(world, [group(20 + i, 3) for i in range(4)], [1.0, 1.0], resumed, interval=0)
    assert f.pusher.pushed == [3]  # before any step: the engines wait for the restored weights
    trainer.run()
    assert [v for v, _, _ in f.step.calls] == [3, 4]
    assert f.pusher.pushed == [3, 4, 5]
    assert [(step, v["version"], v["dropped_stale"]) for step, v, _ in f.logger.records] == [(4, 4, 6), (5, 5, 6)]
    assert f.logger.records[0][2]  # the first step after a resume prints its line
    assert f.checkpointer.saved == []  # checkpoint.interval = 0
    assert f.exporter.exported == [4, None]
