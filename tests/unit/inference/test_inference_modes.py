"""The inference loop's three modes (`rl.mode`) over a fake engine and a fake trainer: when updates are taken, which
versions a sequence's tokens carry, what each round generates; and an inference rank's inputs built once."""

from __future__ import annotations

import types
from collections import deque
from pathlib import Path
from unittest import mock

import pytest
import torch

from pipelinerl_fsdp import train
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.inference import worker as worker_mod
from pipelinerl_fsdp.inference.engine import Request
from pipelinerl_fsdp.job.weight_sync import WeightSyncLayout
from pipelinerl_fsdp.job_inputs import JobInputs
from pipelinerl_fsdp.models import build_model, flavour_args, save_hf_folder
from pipelinerl_fsdp.samples import EngineStats, EvalReport
from pipelinerl_fsdp.tasks import TASKS, make_task
from pipelinerl_fsdp.tasks.arithmetic import ALPHABET
from pipelinerl_fsdp.tokenizer import build_char_tokenizer
from pipelinerl_fsdp.transport.weights import STOP, UPDATE

TOKENS_PER_SEQ = 3  # a request takes this many engine steps (one token per step), plus 0-2 by its group


class FakeEngine:
    """Every step gives each running request one token tagged with the current version; a request finishes after
    TOKENS_PER_SEQ tokens or more (groups of different lengths finish at different steps). Records the number of
    requests in flight at every load."""

    def __init__(self, max_num_seqs: int) -> None:
        self.version, self.cap = 0, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loads: list[tuple[int, int]] = []  # (version, requests in flight when it was loaded)
        self.staged: list[int] = []
        self.tokens = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self, timeout: float = 0.0) -> list[Request]:
        while self.waiting and len(self.running) < self.cap:
            self.running.append(self.waiting.popleft())
        done = []
        for r in self.running:
            r.tokens.append(5)  # a digit of the char tokenizer
            r.logprobs.append(-0.5)
            r.versions.append(self.version)
            if len(r.tokens) == min(TOKENS_PER_SEQ + r.request_id // 2 % 3, r.max_tokens):
                done.append(r)
        self.running = [r for r in self.running if r not in done]
        self.tokens += sum(len(r.tokens) for r in done)
        return done

    def load_update(self, receiver: FakeReceiver, version: int, kv_max_age: int) -> int:
        self.loads.append((version, self.num_unfinished()))
        self.version = version
        return 0

    def stage_update(self, receiver: FakeReceiver) -> None:
        self.staged.append(receiver.last_version)

    def apply_staged(self, version: int) -> None:
        self.load_update(None, version, -1)  # type: ignore[arg-type]

    def stats(self) -> tuple[int, float, float]:
        return self.tokens, 0.0, 0.0

    def close(self) -> None:
        pass


class FakeReceiver:
    """Headers the fake trainer posts; `pending` / `wait_header` / `post` as `transport.weights.WeightReceiver`."""

    def __init__(self) -> None:
        self.headers: deque[tuple[int, int]] = deque()
        self.last_version = 0

    def pending(self) -> bool:
        return bool(self.headers)

    def wait_header(self) -> tuple[int, int]:
        assert self.headers, "the loop blocked on a header the trainer never sends: it would hang"
        kind, self.last_version = self.headers.popleft()
        return kind, self.last_version

    def post(self) -> None:
        pass


class FakeTrainer:
    """The rollout sender's far side: every `groups_per_step` groups is one optimizer step; every `sync_every`
    steps the weights of that step are pushed (a header); after `max_steps` steps, a stop. Like the real trainer
    (`rl.overlap_push`), it takes the next step's groups while a push is out, then waits for the push: its queue
    is full until the engine takes the update."""

    def __init__(
        self, receiver: FakeReceiver, groups_per_step: int, sync_every: int, max_steps: int, final_eval: bool = False
    ) -> None:
        self.receiver, self.groups_per_step, self.sync_every = receiver, groups_per_step, sync_every
        self.final_eval, self.stopped = final_eval, False
        self.max_steps, self.groups, self.steps = max_steps, [], 0
        self.trained_on: list[list[list[int]]] = []  # per step: the versions of its samples
        self.evaluated: list[int] = []  # versions of the evaluation reports received
        self.refused = 0

    def put(self, payload: object, stats: EngineStats, timeout: float | None = None) -> bool:
        waiting = any(kind == UPDATE for kind, _ in self.receiver.headers)
        if self.steps < self.max_steps and waiting and len(self.groups) >= self.groups_per_step:
            self.refused += 1  # waiting for the push to be taken, with the next step's batch in hand
            assert self.refused < 100_000, "the engine never takes the update the trainer waits for: a deadlock"
            return False
        if isinstance(payload, EvalReport):
            self.evaluated.append(payload.version)
        elif self.steps < self.max_steps:
            assert isinstance(payload, list)
            self.groups.append(payload)
            if len(self.groups) >= self.groups_per_step and not waiting:
                batch, self.groups = self.groups[: self.groups_per_step], self.groups[self.groups_per_step :]
                self.trained_on.append([s.versions for g in batch for s in g])
                self.steps += 1
                if self.steps % self.sync_every == 0 or self.steps == self.max_steps:
                    self.receiver.headers.append((UPDATE, self.steps))
        # as the trainer does, the stop waits for the final version's evaluation when one is due
        if (
            self.steps == self.max_steps
            and not self.stopped
            and (not self.final_eval or self.max_steps in self.evaluated)
        ):
            self.receiver.headers.append((STOP, 0))
            self.stopped = True
        return True

    def close(self) -> None:
        pass


def run_mode(mode: str, *extra: str) -> tuple[FakeEngine, FakeTrainer]:
    cfg = load_config(
        [
            "--config",
            "arithmetic",
            f"--rl.mode={mode}",
            "--rl.attempts=2",
            "--rl.batch_size=4",
            "--rl.max_steps=6",
            "--inference.max_num_seqs=4",
            "--eval.every=0",
            "--eval.at_start=false",
            *extra,
        ]
    )
    tok = build_char_tokenizer(ALPHABET)
    task = make_task(cfg.task)
    sync = WeightSyncLayout(engines_on_gpu=False, dtype=torch.float32, workers_join=False, bucket_group_size=2)
    inputs = JobInputs("", "", tok, task, [tok.eos_token_id], 16, 16 + cfg.task.max_new_tokens, sync)
    world = types.SimpleNamespace(rank=1, inference_index=0, inference_ranks=[1], trainer_ranks=[0], rollout_group=None)
    engine, receiver = FakeEngine(cfg.inference.max_num_seqs), FakeReceiver()
    trainer = FakeTrainer(
        receiver, cfg.rl.batch_size // cfg.rl.attempts, cfg.rl.sync_every, cfg.rl.max_steps, cfg.eval.every > 0
    )
    with (
        mock.patch.object(worker_mod, "resume_point", return_value=(None, [])),
        mock.patch.object(worker_mod, "build_engine", return_value=(engine, receiver)),
        mock.patch.object(worker_mod, "RolloutSender", return_value=trainer),
    ):
        worker_mod.run_inference(cfg, world, inputs, 0)  # type: ignore[arg-type]
    assert trainer.steps == cfg.rl.max_steps
    return engine, trainer


def test_pipeline_takes_updates_between_steps_with_sequences_in_flight():
    engine, trainer = run_mode("pipeline")
    assert [v for v, _ in engine.loads] == list(range(1, 7))
    assert any(in_flight for _, in_flight in engine.loads)  # never waits for the engine to drain
    mixed = [v for step in trainer.trained_on for v in step if len(set(v)) > 1]
    assert mixed, "no sequence continued under new weights"
    assert all(v == sorted(v) for step in trainer.trained_on for v in step)  # versions only move forward


def test_async_loads_only_a_drained_engine_and_sequences_keep_one_version():
    engine, trainer = run_mode("async")
    assert engine.loads and all(in_flight == 0 for _, in_flight in engine.loads)
    assert all(len(set(v)) == 1 for step in trainer.trained_on for v in step)
    assert len(engine.staged) >= len(engine.loads)  # received at once, loaded later (newer ones replace older)


def test_async_evaluates_exactly_the_versions_due_even_when_newer_ones_arrive_first():
    """eval.every = 2: the trainer pushes version 3 while 2 is staged and due; 2 must not be replaced, and the
    trainer (waiting for its push) must not deadlock the engine that drains to load it."""
    engine, trainer = run_mode(
        "async", "--eval.every=2", "--task.eval_size=8", "--rl.batch_size=2", "--inference.max_num_seqs=8"
    )
    assert sorted(set(trainer.evaluated)) == [2, 4, 6]
    assert trainer.refused > 0  # the trainer did wait on the engine: the case the holding is for
    assert all(in_flight == 0 for _, in_flight in engine.loads)


def test_conventional_generates_each_round_under_the_last_synced_weights():
    engine, trainer = run_mode("conventional", "--rl.sync_every=2", "--checkpoint.interval=2")
    assert [v for v, _ in engine.loads] == [2, 4, 6] and all(n == 0 for _, n in engine.loads)
    for step, versions in enumerate(trainer.trained_on):
        # steps 2r and 2r+1 train on round r's samples, all generated by the version synced before it (2r)
        assert {x for v in versions for x in v} == {step // 2 * 2}, (step, versions)


@pytest.fixture()
def model_folder(tmp_path: Path) -> Path:
    tok = build_char_tokenizer(ALPHABET)
    args = flavour_args("debug", vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_hf_folder(tmp_path, args, build_model(args, seed=0).state_dict())
    tok.save_pretrained(str(tmp_path))
    return tmp_path


def test_an_inference_rank_builds_its_task_and_tokenizer_once(model_folder, tmp_path):
    """The whole RL stage of one inference rank (`train.run_rl`), its engine and trainer faked: every tokenizer
    load and task construction is counted where it happens (transformers, the task class)."""
    cfg = load_config(
        [
            "--config",
            "arithmetic",
            f"--model.path={model_folder}",
            f"--job.output_dir={tmp_path / 'out'}",
            "--rl.max_steps=2",
            "--eval.every=0",
        ]
    )
    world = types.SimpleNamespace(
        rank=1,
        inference_index=0,
        inference_ranks=[1],
        trainer_ranks=[0],
        is_trainer=False,
        rollout_group=None,
        backend="gloo",
    )
    receiver = FakeReceiver()
    trainer = FakeTrainer(receiver, cfg.rl.batch_size // cfg.rl.attempts, 1, cfg.rl.max_steps)
    engine = FakeEngine(cfg.inference.max_num_seqs)
    task_cls = TASKS[cfg.task.name]
    from transformers import AutoTokenizer

    loads = []
    real_load = AutoTokenizer.from_pretrained.__func__

    def counted_load(cls, *a, **k):
        loads.append(a[0])
        return real_load(cls, *a, **k)

    with (
        mock.patch.object(AutoTokenizer, "from_pretrained", classmethod(counted_load)),
        mock.patch.object(task_cls, "__init__", side_effect=task_cls.__init__, autospec=True) as built,
        mock.patch.object(worker_mod, "build_engine", return_value=(engine, receiver)),
        mock.patch.object(worker_mod, "RolloutSender", return_value=trainer),
        mock.patch.object(train, "bind_cpu_cores"),
    ):
        train.run_rl(cfg, world)  # type: ignore[arg-type]
    assert trainer.steps == cfg.rl.max_steps  # the loop ran to the stop
    assert built.call_count == 1 and len(loads) == 1, (built.call_count, loads)
