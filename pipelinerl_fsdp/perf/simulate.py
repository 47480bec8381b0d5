"""A discrete-event simulator of the job: engines with their slots and continuous batching, groups that complete
with their last attempt, the rollout queues and their backpressure, the collector, the trainer's steps in parts,
the weight pushes and the engines' pauses, for each `rl.mode`. Deterministic for a seed; an engine's live set is
constant between two events, so it jumps over all the decode steps in between at once (`DecodeCost.steps_s`).

What it follows (the project's code, read for it):
- an engine (`inference/worker.py`) admits a prompt's `attempts` together when they fit in its `slots`
  (`inference.max_num_seqs`); each sequence then takes one decode step per token, its first in the step that
  admits it (with the prompt's prefill added to that step); a finished group goes to the engine's send queue
  (`inference.max_queued_groups`, plus the one its sender thread holds); while that is full the engine's loop
  waits: it neither admits nor (reference engine; `decode_while_blocked` for vLLM, whose engine runs on) steps.
- the trainer's receiver holds one part of a step (`rl.waves`) plus the one its thread holds, filled in the order
  the groups were finished; the collector takes a part when the trainer asks for it, dropping groups whose oldest
  token is more than `max_lag` versions old (`training/collector.py`).
- pipeline: after each optimizer step whose version is a multiple of `sync_every` the trainer pushes; every
  engine joins the broadcast at its next step boundary (at once when it is not stepping), waits for the slowest
  one (one collective), receives (`PushCost.transfer_s`) and loads (`load_s`), then goes on with its sequences;
  with `overlap_push` the trainer goes on at once and waits for the push only before its next optimizer step.
- async: the same push, received without loading (a pause of the transfer); the engine then admits nothing until
  it has drained, loads, and admits again; a newer push replaces a staged one.
- conventional: each engine generates its share of the round's sync_every x batch_size samples, then waits for
  the next push; the collector takes the whole round at its first step, shuffles it and hands out a batch a step.
- colocated: as conventional with G = 1, no broadcast, and the weight copy as the pause (`PushCost.load_s`): pass
  the generation and training costs of the whole machine.
- busy and blocked (`inference/busy.py`, `rl/step_metrics.py`): an engine is busy while it computes steps; its
  occupancy is its mean live sequences over busy time / slots; it is paused from joining a push to resuming, and
  send-blocked while a finished group waits for room; the trainer is busy computing, blocked on pushes, or waiting
  for data.
Left out: scoring time, evaluation, prompt-length spread (one `prompt_tokens`), filters other than max_lag, KV
recomputation, packing loss, and the push slowing the trainer's compute.

Usage: `simulate(SimConfig(...), SimCosts(decode, train, push), lengths, seed=0) -> SimResult`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pipelinerl_fsdp.perf.costs import DecodeCost, PushCost, TrainCost
from pipelinerl_fsdp.perf.engine_sim import World
from pipelinerl_fsdp.perf.lags import LagTally
from pipelinerl_fsdp.perf.lengths import Lengths

MODES = ("pipeline", "async", "conventional", "colocated")


@dataclass(frozen=True)
class SimConfig:
    """The job's layout and settings, named as in the config (`rl.*`, `inference.*`)."""

    mode: str = "pipeline"
    engines: int = 1
    slots: int = 64  # inference.max_num_seqs
    batch_size: int = 64
    attempts: int = 8
    steps: int = 100  # rl.max_steps
    sync_every: int = 1
    max_lag: int = 8
    waves: int = 1
    overlap_push: bool = True
    prompt_tokens: int = 0
    max_new_tokens: int = 0  # lengths are cut here (0: as drawn)
    send_queue_groups: int = 2  # inference.max_queued_groups
    decode_while_blocked: bool = False  # vLLM: the engine runs on while its loop waits to send
    prefix_cache: bool = False  # a group's attempts prefill their shared prompt once
    warmup_steps: int = -1  # steps left out of the steady state; -1: 10% of the steps, whole rounds

    def check(self) -> None:
        """An error naming the first impossible value."""
        groups = self.batch_size // self.attempts
        rules = [
            ("mode", self.mode in MODES, f"one of {MODES}"),
            ("engines", self.engines >= 1, ">= 1"),
            ("attempts", self.attempts >= 1, ">= 1"),
            ("slots", self.slots >= self.attempts, ">= attempts (a group is admitted whole)"),
            ("batch_size", self.batch_size >= 1 and self.batch_size % self.attempts == 0, "a multiple of attempts"),
            ("steps", self.steps >= 1, ">= 1"),
            (
                "sync_every",
                self.sync_every >= 1 and (self.mode != "colocated" or self.sync_every == 1),
                ">= 1 (1 colocated)",
            ),
            ("max_lag", self.max_lag >= 0, ">= 0"),
            (
                "waves",
                self.waves >= 1 and groups % self.waves == 0 and (self.mode != "colocated" or self.waves == 1),
                "divides batch_size / attempts (1 colocated, which generates the whole batch first)",
            ),
            ("prompt_tokens", self.prompt_tokens >= 0, ">= 0"),
            ("max_new_tokens", self.max_new_tokens >= 0, ">= 0"),
            ("send_queue_groups", self.send_queue_groups >= 1, ">= 1"),
            ("warmup_steps", -1 <= self.warmup_steps < self.steps, "in [-1, steps)"),
        ]
        for key, ok, must in rules:
            if not ok:
                raise ValueError(f"SimConfig.{key} = {getattr(self, key)!r}: must be {must}")

    def warmup(self) -> int:
        if self.warmup_steps >= 0:
            return self.warmup_steps
        w = math.ceil(self.steps / 10 / self.sync_every) * self.sync_every
        return w if w < self.steps else 0


@dataclass(frozen=True)
class SimCosts:
    decode: DecodeCost
    train: TrainCost
    push: PushCost | None = None  # None: updates take no time


@dataclass
class SimResult:
    """Rates and fractions over the steady state (the steps after `warmup_steps`, from the end of the last warm-up
    step to the end of the run), and `*_all` over the whole run from time 0. Engine fractions are of the engines'
    time summed over engines; lags are of every token trained in the steady state."""

    steps: int
    warmup_steps: int
    time_s: float
    steps_per_s: float
    samples_per_s: float
    steps_per_s_all: float
    samples_per_s_all: float
    engine_busy_frac: float
    engine_occupancy: float  # mean live sequences over busy time / slots
    engine_mean_live: float
    engine_paused_frac: float  # the pause share of engine time
    engine_send_blocked_frac: float
    engine_idle_frac: float  # neither stepping nor paused nor blocked: waiting for work (a round, a drain's load)
    trainer_busy_frac: float
    trainer_push_blocked_frac: float
    trainer_data_wait_frac: float
    lag_hist: np.ndarray  # trained tokens at lag 0, 1, ...
    lag_p50: float
    lag_p90: float
    lag_max: int
    lag_mean: float
    lag_by_tenth: np.ndarray  # mean lag per tenth of the completion
    dropped_samples: int
    dropped_groups: int
    updates: int  # updates the engines loaded
    gen_tokens_per_s: float
    train_tokens_per_s: float
    step_ends: np.ndarray = field(repr=False)  # when each step ended


@dataclass
class _Trainer:
    state: str = "wait"  # wait, compute, pushwait, opt, pushblock, done
    step: int = 0
    version: int = 0
    wave: int = 0
    need: int = 0
    got: list[int] = field(default_factory=list)
    step_groups: list[int] = field(default_factory=list)
    round: deque[int] = field(default_factory=deque)
    mark: float = 0.0
    # per step: start, data wait, push blocked, compute
    start: float = 0.0
    wait_s: float = 0.0
    push_s: float = 0.0
    compute_s: float = 0.0
    records: list[tuple[float, float, float, float, float]] = field(default_factory=list)


def simulate(cfg: SimConfig, costs: SimCosts, lengths: Lengths, seed: int = 0) -> SimResult:
    """Run the job of `cfg` on `costs`, completion lengths drawn from `lengths` (numpy Generator of `seed`)."""
    cfg.check()
    return _Sim(cfg, costs, lengths, seed).run()


class _Sim(World):
    def __init__(self, cfg: SimConfig, costs: SimCosts, lengths: Lengths, seed: int) -> None:
        super().__init__(cfg, costs, lengths, np.random.default_rng(seed))
        self.tr = _Trainer()
        self.wave_groups = cfg.batch_size // cfg.attempts // cfg.waves
        self.channel_cap = self.wave_groups + 1  # the receive queue holds a part; its thread one more
        self.channel: deque[int] = deque()
        self.warm = cfg.warmup()
        self.tally = LagTally()
        self.snap0: tuple[float, ...] | None = None
        self.dropped = [0, 0]
        self.step_tokens: list[int] = []
        self.drop_limit = 10 * cfg.steps * cfg.batch_size // cfg.attempts  # a run dropping more never ends

    # ---- the data path: engines' send queues -> the trainer's receiver -> the collector ----
    def pump(self, now: float) -> None:
        """Move finished groups forward while there is room (oldest first), feeding a trainer that waits."""
        tr = self.tr
        while True:
            while len(self.channel) < self.channel_cap and self.outbox:
                e, g = self.outbox.popleft()
                self.channel.append(g)
                self.engines[e].sent(now)
            if tr.state == "wait" and tr.need and self.channel:
                self.take(now)
                continue
            return

    def take(self, now: float) -> None:
        tr = self.tr
        while tr.need and self.channel:
            g = self.channel.popleft()
            lag = tr.version - self.g_version[g]
            if self.cfg.mode in ("pipeline", "async") and lag > self.cfg.max_lag:
                self.dropped[0] += self.cfg.attempts
                self.dropped[1] += 1
                if self.dropped[1] > self.drop_limit:
                    raise RuntimeError(
                        f"{self.dropped[1]} groups dropped as stale by step {tr.step}: max_lag = {self.cfg.max_lag} "
                        "is below what this layout's queues hold, so the trainer starves"
                    )
                continue
            tr.got.append(g)
            tr.need -= 1
        if tr.need == 0:
            tr.wait_s += now - tr.mark
            if self.cfg.mode in ("conventional", "colocated"):
                order = self.rng.permutation(len(tr.got))  # collector.shuffled_round
                tr.round.extend(tr.got[i] for i in order)
                tr.got = []
            self.compute_wave(now)

    # ---- the trainer ----
    def begin_step(self, now: float) -> None:
        tr = self.tr
        tr.start, tr.wait_s, tr.push_s, tr.compute_s, tr.wave, tr.step_groups = now, 0.0, 0.0, 0.0, 0, []
        self.begin_wave(now)

    def begin_wave(self, now: float) -> None:
        tr = self.tr
        if self.cfg.mode in ("conventional", "colocated") and tr.round:
            self.compute_wave(now)
            return
        per_round = self.cfg.sync_every if self.cfg.mode in ("conventional", "colocated") else 1.0 / self.cfg.waves
        tr.need = round(per_round * self.cfg.batch_size / self.cfg.attempts)
        tr.state, tr.mark = "wait", now
        self.pump(now)

    def compute_wave(self, now: float) -> None:
        tr = self.tr
        if tr.round:
            tr.got = [tr.round.popleft() for _ in range(self.wave_groups)]
        groups, tr.got = tr.got, []
        tr.step_groups += groups
        tokens = float(sum(self.g_tokens[g] for g in groups))
        sq = float(sum(self.g_sq[g] for g in groups))
        train = self.costs.train
        dt = train.part_s_of(tokens, train.micro_batches(tokens), sq)
        tr.state = "compute"
        tr.compute_s += dt
        self.schedule(now + dt, "train", -1)

    def trainer_event(self, now: float) -> None:
        tr = self.tr
        if tr.state == "compute":
            tr.wave += 1
            if tr.wave < self.cfg.waves:
                self.begin_wave(now)
            elif self.push_active:
                tr.state, tr.mark = "pushwait", now
            else:
                self.optimizer(now)
        elif tr.state == "opt":
            self.after_optimizer(now)

    def optimizer(self, now: float) -> None:
        self.tr.state = "opt"
        self.tr.compute_s += self.costs.train.step_base_s
        self.schedule(now + self.costs.train.step_base_s, "train", -1)

    def after_optimizer(self, now: float) -> None:
        tr = self.tr
        tr.version += 1
        if tr.version % self.cfg.sync_every == 0:
            self.start_push(now, tr.version)
            waits = not self.cfg.overlap_push or self.cfg.mode == "colocated"  # colocated copies in its step
            if waits and self.push_active:
                tr.state, tr.mark = "pushblock", now
                return
        self.end_step(now)

    def push_done(self, now: float) -> None:
        tr = self.tr
        if tr.state == "pushwait":
            tr.push_s += now - tr.mark
            self.optimizer(now)
        elif tr.state == "pushblock":
            tr.push_s += now - tr.mark
            self.end_step(now)

    def end_step(self, now: float) -> None:
        tr = self.tr
        trained = tr.version - 1
        tr.records.append((tr.start, tr.wait_s, tr.push_s, tr.compute_s, now))
        self.step_tokens.append(sum(self.g_tokens[g] for g in tr.step_groups))
        tr.step += 1
        if tr.step > self.warm:
            gs = np.asarray(tr.step_groups, dtype=np.int64)
            a = self.cfg.attempts
            eng = np.repeat(np.asarray([self.g_engine[g] for g in gs], dtype=np.int64), a)
            first = np.repeat(np.asarray([self.g_step[g] for g in gs], dtype=np.int64), a)
            length = np.concatenate([self.g_lengths[g] for g in gs]) if len(gs) else np.zeros(0, np.int64)
            self.tally.add(self.history, trained, eng, first, length)
        if tr.step == self.warm:
            self.snap0 = self.snapshot(now)
        if tr.step == self.cfg.steps:
            tr.state = "done"
            return
        self.begin_step(now)

    # ---- the run ----
    def run(self) -> SimResult:
        for e in self.engines:
            e.start(0.0)
        self.snap0 = self.snapshot(0.0) if self.warm == 0 else None
        self.begin_step(0.0)
        while self.tr.state != "done":
            if not self.events:
                raise RuntimeError(f"the simulation stalled at step {self.tr.step} ({self.tr.state}): nothing to do")
            now, _, kind, who, token = heapq.heappop(self.events)
            if kind == "train":
                self.trainer_event(now)
            else:
                self.engine_event(now, kind, who, token)
        return self.result(now)

    def result(self, end: float) -> SimResult:
        cfg, tr = self.cfg, self.tr
        assert self.snap0 is not None
        snap1 = self.snapshot(end)
        d = [b - a for a, b in zip(self.snap0, snap1)]
        busy, seq_s, paused, blocked, idle, gen = d[:6]
        ends = np.array([r[4] for r in tr.records])
        t0 = ends[self.warm - 1] if self.warm else 0.0
        window = max(end - t0, 1e-300)
        steady = tr.records[self.warm :]
        span = sum(r[4] - r[0] for r in steady)
        trained_tokens = sum(self.step_tokens[self.warm :])
        n_e = cfg.engines
        return SimResult(
            steps=cfg.steps,
            warmup_steps=self.warm,
            time_s=end,
            steps_per_s=len(steady) / window,
            samples_per_s=len(steady) * cfg.batch_size / window,
            steps_per_s_all=cfg.steps / end,
            samples_per_s_all=cfg.steps * cfg.batch_size / end,
            engine_busy_frac=busy / (n_e * window),
            engine_occupancy=seq_s / busy / cfg.slots if busy > 0 else float("nan"),
            engine_mean_live=seq_s / busy if busy > 0 else float("nan"),
            engine_paused_frac=paused / (n_e * window),
            engine_send_blocked_frac=blocked / (n_e * window),
            engine_idle_frac=idle / (n_e * window),
            trainer_busy_frac=sum(r[3] for r in steady) / span,
            trainer_push_blocked_frac=sum(r[2] for r in steady) / span,
            trainer_data_wait_frac=sum(r[1] for r in steady) / span,
            lag_hist=self.tally.hist.copy(),
            lag_p50=self.tally.percentile(50),
            lag_p90=self.tally.percentile(90),
            lag_max=self.tally.max(),
            lag_mean=self.tally.mean(),
            lag_by_tenth=self.tally.by_tenth(),
            dropped_samples=self.dropped[0],
            dropped_groups=self.dropped[1],
            updates=sum(e.updates for e in self.engines),
            gen_tokens_per_s=gen / window,
            train_tokens_per_s=trained_tokens / window,
            step_ends=ends,
        )
