"""The trainer ranks of the RL stage: receive rollouts, pack, IS-weighted policy-gradient step, push weights.

The first trainer rank is the collector: its receiver thread takes finished groups from every inference rank;
each step the collector assembles `rl.batch_size` samples of whole, fresh groups (`collector.py`), splits them
across the trainer ranks by token count, and every trainer rank trains on its share in lockstep. After the
optimizer step all trainer ranks gather the weights (LoRA: the adapters) and the first one broadcasts them."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelinerl_fsdp.checkpoint_layout import resume_point
from pipelinerl_fsdp.config import (
    CheckpointConfig,
    Config,
    LossConfig,
    MetricsConfig,
    RLConfig,
    TrainerConfig,
)
from pipelinerl_fsdp.job.world import World, waiting_for
from pipelinerl_fsdp.job_inputs import JobInputs
from pipelinerl_fsdp.models.lora import adapter_parameters
from pipelinerl_fsdp.records import total
from pipelinerl_fsdp.rl.batching import split_balanced
from pipelinerl_fsdp.rl.loss import LossStats
from pipelinerl_fsdp.rl.normalization import assign_loss_weights
from pipelinerl_fsdp.rl.step_metrics import StepTimes, mismatch_error, step_metrics, update_pauses
from pipelinerl_fsdp.runtime import stopping
from pipelinerl_fsdp.runtime.faults import maybe_fail, nan_loss_at
from pipelinerl_fsdp.runtime.processes import kill_descendants
from pipelinerl_fsdp.runtime.stopping import StopRequested
from pipelinerl_fsdp.samples import EngineStats, Sample
from pipelinerl_fsdp.tasks import Task
from pipelinerl_fsdp.training.checkpoint import Checkpointer
from pipelinerl_fsdp.training.collector import Collector
from pipelinerl_fsdp.training.evaluation import EvalAggregator
from pipelinerl_fsdp.training.export import PolicyExporter
from pipelinerl_fsdp.training.metrics import MetricsLogger, rl_console
from pipelinerl_fsdp.training.policy import Policy, build_policy, load_sharded
from pipelinerl_fsdp.training.rl_step import RLStep
from pipelinerl_fsdp.training.rollout_log import RolloutLog, as_text
from pipelinerl_fsdp.transport.rollouts import RolloutReceiver, scatter_samples
from pipelinerl_fsdp.transport.stalls import push_stall_s
from pipelinerl_fsdp.transport.store_group import ENGINE_BUCKET_GROUP, join_store_group, store_address
from pipelinerl_fsdp.transport.weights import PushStats, WeightSender


class MismatchError(RuntimeError):
    """The engines and the trainer disagree on the log-probs of tokens sampled with the same weights."""


@dataclass
class TrainerParts:
    """RLTrainer's collaborators, built by `run_trainer` (fakes in unit tests). The collector and the rollout
    receiver exist on the first trainer rank only."""

    world: World
    task: Task
    policy: Policy
    step: RLStep
    pusher: WeightSender
    collector: Collector | None
    receiver: RolloutReceiver | None
    logger: MetricsLogger
    rollout_log: RolloutLog
    evals: EvalAggregator
    checkpointer: Checkpointer
    exporter: PolicyExporter


class RLTrainer:
    """One trainer rank of the RL stage over its collaborators (`TrainerParts`): `train_step` per step,
    `checkpoint`, `close`; `run` loops over them. Every method is collective over the trainer ranks."""

    def __init__(
        self,
        rl: RLConfig,
        trainer: TrainerConfig,
        loss: LossConfig,
        metrics: MetricsConfig,
        checkpoint: CheckpointConfig,
        eval_every: int,
        max_new_tokens: int,
        max_num_seqs: int,
        timeout_s: float,
        parts: TrainerParts,
        resumed: dict[str, Any] | None = None,
    ) -> None:
        """`resumed`: the meta dict of the checkpoint the policy was restored from (`Checkpointer.load`); the
        run continues at its step and version, and the engines get its weights first."""
        self.rl, self.trainer, self.loss, self.metrics, self.checkpoint_cfg = rl, trainer, loss, metrics, checkpoint
        self.eval_every, self.max_new_tokens, self.max_num_seqs = eval_every, max_new_tokens, max_num_seqs
        self.timeout_s = timeout_s
        self.world, self.task, self.policy, self.step = parts.world, parts.task, parts.policy, parts.step
        self.sender, self.collector, self.receiver = parts.pusher, parts.collector, parts.receiver
        self.logger, self.rollout_log, self.evals = parts.logger, parts.rollout_log, parts.evals
        self.checkpointer, self.exporter = parts.checkpointer, parts.exporter
        self._evals_done: list[dict[str, float]] = []  # completed since the last record, oldest first
        self.version = self.start_step = 0
        self.nonfinite_in_row = self.skipped_steps = 0
        self._mismatch_checked = False  # rl.check_mismatch runs once, on the first step with lag-0 tokens
        if resumed is not None:
            self.start_step, self.version = resumed["step"], resumed["version"]
            if self.collector is not None:
                self.collector.load_state_dict(resumed)
            self.sender.push(self.version)  # the engines wait for the restored weights before generating
        self._engines_before = EngineStats()
        self._pauses_before = (0.0, 0.0)  # the engines' cumulative update pauses (ms, count) at the last record
        self._t_prev = time.perf_counter()
        self._push_s = 0.0  # the last step's weight push (wall time; 0 when nothing was pushed)

    def _my_share(self) -> list[Sample]:
        """This rank's samples of the next part of the batch (`rl.waves`; the whole batch by default): the
        collector (first trainer rank) assembles it, splits it by tokens and sends every trainer rank its share as
        tensors."""
        parts, stop = None, 0
        if self.collector is not None:
            try:
                batch = self.collector.next_batch(self.version, self.timeout_s, wave_groups(self.rl))
                rl, budget = self.rl, self.max_new_tokens
                assign_loss_weights(batch, self.loss, rl.batch_size, rl.attempts, budget)
                parts = split_balanced(batch, len(self.world.trainer_ranks))
                self._batch += [s for part in parts for s in part]  # for the metrics and rollout logs (this rank)
            except StopRequested as e:  # the other trainer ranks stop here too, at the same step
                stop = e.signum
        with waiting_for("this step's share of the batch from the first trainer rank", self.world.rank):
            return scatter_samples(parts, self.world.trainer_group, 0, self.world.trainer_rank, stop=stop)

    def train_step(self, step: int) -> None:
        """Optimizer step number `step` (0-based): data, forward/backward, update, weight push, metrics."""
        rl, world = self.rl, self.world
        maybe_fail(world.rank, step)
        t_start = time.perf_counter()
        self._batch, waited = [], 0.0
        lr = self.policy.lr  # the step's (the schedule moves with the optimizer step)
        finished: PushStats | None = None
        finish_s = 0.0

        def shares() -> Iterator[list[Sample]]:  # each part trained as soon as it is in hand (rl.waves)
            nonlocal waited
            while True:
                t_wait = time.perf_counter()
                mine = self._my_share()
                waited += time.perf_counter() - t_wait
                yield mine

        def before_update(sums: LossStats) -> None:  # after the last backward, before the update
            nonlocal finished, finish_s
            if nan_loss_at(step):
                for p in self.policy.model.parameters():  # as if the loss had been NaN: every gradient NaN
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
            self._check_mismatch(sums)
            t_finish = time.perf_counter()
            with waiting_for(f"the engines to receive weight version {self.version}", world.rank):
                finished = self.sender.finish()  # an overlapped push may still read the parameters changed now
            finish_s = time.perf_counter() - t_finish

        sums, grad_norm = self.step.run(shares(), rl.waves, self.version, before_update)
        # the step's time waiting for data, as if it had come first (busy time = the rest)
        t_data = t_start + waited
        trained_version = self.version
        if not math.isfinite(grad_norm):  # nothing was applied: same weights, same version, nothing to push
            self.nonfinite_in_row += 1
            self.skipped_steps += 1
            if self.nonfinite_in_row >= self.trainer.max_nonfinite_steps:
                raise FloatingPointError(
                    f"non-finite loss or gradient in {self.nonfinite_in_row} steps in a row (up to step {step + 1}; "
                    f"trainer.max_nonfinite_steps = {self.trainer.max_nonfinite_steps}): stopping the run"
                )
        else:
            self.nonfinite_in_row = 0
            self.version += 1
        last = step + 1 == rl.max_steps
        # the last version always reaches the engines when they evaluate it (conventional rounds may end early)
        sync = self.version != trained_version and (self.version % rl.sync_every == 0 or (last and self.eval_every > 0))
        push, t_push = None, time.perf_counter()
        if sync:
            with waiting_for(f"the engines to receive weight version {self.version}", world.rank):
                push = self.sender.push(self.version, wait=not rl.overlap_push)
        push = push or finished  # the statistics of the last push that has ended
        # the trainer's time blocked on pushes this step: this one, and the wait for the previous one above
        self._push_s = time.perf_counter() - t_push + finish_s
        t_end = time.perf_counter()
        if self.collector is not None:
            if last and self.eval_every and self.evals.set_names:  # the final policy's evaluation: the last step's
                self.collector.wait_for(
                    self._final_eval_done,
                    self.version,
                    self.timeout_s,
                    f"the engines' evaluation of the final version {self.version}",
                )
            self._log(
                step,
                trained_version,
                sums,
                grad_norm,
                lr,
                push,
                StepTimes(t_start, t_data, t_end, self._t_prev, self._push_s),
            )
        self._t_prev = t_end

    def _check_mismatch(self, sums: LossStats) -> None:
        """`rl.check_mismatch`: before the first update, on every trainer rank (`sums` reduced over them)."""
        bound = self.rl.check_mismatch
        if self._mismatch_checked or not bound:
            return
        if sums.lag0_tokens > 0:  # else the next step checks (no token of the trained version in this batch)
            self._mismatch_checked = True
            error = mismatch_error(sums, bound)
            if error is not None:
                raise MismatchError(error)

    def _log(
        self,
        step: int,
        trained_version: int,
        sums: LossStats,
        grad_norm: float,
        lr: float,
        push: PushStats | None,
        times: StepTimes,
    ) -> None:
        c = self.collector
        assert c is not None
        engines = total(c.engine_stats.values(), EngineStats())
        values = step_metrics(
            self._batch,
            trained_version,
            sums,
            engines,
            self._engines_before,
            times,
            self.max_num_seqs,
            self.task.multi_turn,
        )
        self._engines_before = engines
        pauses, self._pauses_before = update_pauses(engines, self._pauses_before, c.pause_max)
        c.pause_max = {}
        values.update(pauses)
        values.update(
            {
                "version": self.version,
                "samples": (step + 1) * self.rl.batch_size,
                "grad_norm": grad_norm,
                "lr": lr,
                "broadcast_mb_per_s": push.mb_per_s if push else float("nan"),
                "push_mb": push.bytes / 1e6 if push else float("nan"),  # what one update moves (LoRA: adapters)
                "push_s": self._push_s,
                "queue_size": c.queued_samples(),
                "inference_engines": len(c.engine_stats),  # the engines whose stats the step's sums add up
                "dropped_stale": c.counts.dropped_samples,
                "dropped_stale_groups": c.counts.dropped_groups,
                "filtered_zero_adv": c.counts.filtered_samples,
                "skipped_nonfinite_steps": self.skipped_steps,
                "dropped_nonfinite": c.counts.nonfinite_samples,
                "skipped_long_prompts": engines.skipped_prompts,
            }
        )
        if c.max_gid and (epoch := self.task.epoch(max(c.max_gid.values()))) is not None:
            values["data_epoch"] = epoch  # of the newest problem the engines have sent
        self._absorb_evals()
        evals, self._evals_done = self._evals_done, []  # two can complete within one step, e.g. with the final one
        last = step + 1 == self.rl.max_steps
        console = (step + 1) % self.metrics.log_every == 0 or step == self.start_step or last
        self.logger.log(step + 1, values, console=console, evals=evals)
        self._log_rollouts(step + 1, trained_version, console)

    def _absorb_evals(self) -> None:
        """Join the evaluation reports that arrived; completed sets wait in `_evals_done` for the next record."""
        c = self.collector
        assert c is not None
        for report in c.eval_reports:
            done = self.evals.add(report)
            if done:
                self._evals_done.append(done)
        c.eval_reports.clear()

    def _final_eval_done(self) -> bool:
        self._absorb_evals()
        return self.evals.complete(self.version)

    def _log_rollouts(self, step: int, trained_version: int, console: bool) -> None:
        n_tb = self.metrics.rollouts_in_tensorboard if console and self.metrics.tensorboard else 0
        if not (self.rollout_log.due(step) or n_tb):
            return
        records = self.rollout_log.records(
            self._batch if self.rollout_log.due(step) else self._batch[:n_tb], trained_version
        )
        if self.rollout_log.due(step):
            self.rollout_log.write(step, records)
        for i, r in enumerate(records[:n_tb]):
            self.logger.log_text(step, f"rollouts/{i}", as_text(r))

    def checkpoint(self, step: int) -> None:
        """Save a checkpoint after `step` optimizer steps (collective)."""
        c = self.collector
        self.checkpointer.save(step, {"version": self.version, **(c.state_dict() if c else {})})

    def run(self) -> None:
        interval, last = self.checkpoint_cfg.interval, self.rl.max_steps
        if self.start_step >= last and self.world.is_main:
            print(f"[rl] the checkpoint is at step {self.start_step} of {last}: nothing left to train", flush=True)
        saved = self.start_step  # the newest checkpoint's step (or where the run began)
        for step in range(self.start_step, last):
            try:
                self.train_step(step)
            except StopRequested as stop:  # raised before this step changed the weights: `step` steps are done
                self._stop(step, saved, stop)
                raise
            if interval and ((step + 1) % interval == 0 or step + 1 == last):  # and a final one
                self.checkpoint(step + 1)
                saved = step + 1
            every = self.checkpoint_cfg.export_every
            if every and (step + 1) % every == 0 and step + 1 < last:  # the last step's policy goes to final/
                self.exporter.export(step + 1)
        self.close()

    def _stop(self, step: int, saved: int, stop: StopRequested) -> None:
        """A signal stopped the run after `step` optimizer steps: save them if the newest checkpoint is older."""
        if step > saved:
            t0 = time.perf_counter()
            self.checkpoint(step)
            if self.world.is_main:
                print(
                    f"[rl] {stop}: saved the checkpoint of step {step} in {time.perf_counter() - t0:.1f} s",
                    flush=True,
                )
        elif self.world.is_main:
            print(f"[rl] {stop}: the newest checkpoint is of step {step} already", flush=True)
        self.logger.close()

    def close(self) -> None:
        """Tell the engines to stop, drain their last rollouts, export the final policy."""
        if stopping.requested() is None:  # else the engines are gone: nothing to tell or to drain
            self.sender.stop()
            if self.receiver is not None:
                self.receiver.drain()
        self.exporter.export(None)
        self.logger.close()


def wave_groups(rl: RLConfig) -> int:
    """Groups in each of a step's parts (`rl.waves`, which validation makes divide the step's groups)."""
    return rl.batch_size // rl.attempts // rl.waves


def run_trainer(cfg: Config, world: World, inputs: JobInputs, bucket_bytes: int) -> None:
    """This trainer rank's collaborators (policy, step, weight pusher, collector and rollout receiver, metrics,
    checkpoints, exports), the restored checkpoint if there is one, and the loop over them."""
    rl, device, n_engines, task = cfg.rl, world.device, len(world.inference_ranks), inputs.task
    model_path = inputs.model_path
    model = load_sharded(model_path, world, cfg.trainer, cfg.lora, cfg.job.seed)  # adapters on it under LoRA
    policy = build_policy(model, cfg.trainer.optimizer, rl.max_steps)
    ref_model = None
    if rl.kl_coef > 0:  # the frozen initial policy, sharded like the trained one; under LoRA the policy, adapters off
        ref_model = model if cfg.lora.enabled else load_sharded(model_path, world, cfg.trainer).requires_grad_(False)
    step = RLStep(
        policy,
        ref_model,
        cfg.loss,
        rl.kl_coef,
        cfg.trainer,
        cfg.inference.temperature,
        world.trainer_group,
        device,
        len(world.trainer_ranks),
    )
    bucket_group = None
    sync = inputs.weight_sync
    if world.is_main and sync.workers_join:  # the engine's workers receive the buckets themselves
        bucket_group = join_store_group(
            *store_address(),
            ENGINE_BUCKET_GROUP,
            0,
            sync.bucket_group_size,
            world.backend,
            device,
            cfg.world.timeout_s,
        )
    pusher = WeightSender(
        policy.model,
        world.weight_group,
        world.trainer_ranks[0],
        world.is_main,
        sync.push_dtype,
        sync.bucket_device(device),
        bucket_bytes,
        bucket_group,
        cfg.world.timeout_s,
        stall_s=push_stall_s(cfg.rl.mode, cfg.world.timeout_s),
        params=adapter_parameters(policy.model) if sync.lora is not None else None,
    )
    collector: Collector | None = None
    receiver: RolloutReceiver | None = None
    if world.is_main:
        # it holds what the trainer takes at once (a step or a part): with the engines' send queues it bounds the lag
        receiver = RolloutReceiver(world.rollout_group, n_engines, wave_groups(rl))
        collector = Collector(receiver, rl, n_engines, random.Random(cfg.job.seed))
    # held-out evaluation runs on the engines; their reports are joined here
    eval_sets = list(task.eval_sets())
    evals = EvalAggregator(eval_sets, n_engines, cfg.eval.pass_k)
    ck_folder = cfg.checkpoint.folder_under(cfg.job.output_dir)
    checkpointer = Checkpointer(ck_folder, cfg.checkpoint.keep, policy, world.trainer_group, world.is_main)
    resume_from, skipped = resume_point(cfg.checkpoint, cfg.job.output_dir)
    for warning in skipped if world.is_main else []:
        print(f"[rl] warning: {warning}", flush=True)
    resumed = checkpointer.load(resume_from) if resume_from is not None else None
    out = Path(cfg.job.output_dir)
    logger = MetricsLogger(
        out / "rl",
        cfg.metrics.tensorboard,
        world.is_main,
        prefix="rl/",
        total_steps=rl.max_steps,
        console_fields=rl_console(eval_sets[0] if eval_sets else None),
        resume_step=resumed["step"] if resumed else 0,  # 0 in a fresh run
    )
    rollout_log = RolloutLog(out / "rl" / "rollouts", inputs.tokenizer, task, cfg.job.seed, cfg.metrics.rollouts_every)
    exporter = PolicyExporter(policy.model, world, inputs.tokenizer, out, model_path)
    parts = TrainerParts(
        world, task, policy, step, pusher, collector, receiver, logger, rollout_log, evals, checkpointer, exporter
    )
    trainer = RLTrainer(
        rl,
        cfg.trainer,
        cfg.loss,
        cfg.metrics,
        cfg.checkpoint,
        cfg.eval.every,
        cfg.task.max_new_tokens,
        cfg.inference.max_num_seqs,
        cfg.world.timeout_s,
        parts,
        resumed,
    )
    if resumed is not None and world.is_main:
        print(f"[rl] resumed from {resume_from} at step {trainer.start_step}, version {trainer.version}", flush=True)
    interval = cfg.checkpoint.interval
    stopping.install(graceful=interval > 0 and cfg.checkpoint.save_on_stop, on_exit=kill_descendants)
    trainer.run()
