"""The simulator's engines and the world they share (`perf/simulate.py` drives them): an engine's live set, its
jumps from one event to the next, its admissions, send queue and weight updates; the event queue, the groups and
the weight push every engine joins. The semantics are those of `inference/worker.py` (see simulate.py)."""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from pipelinerl_fsdp.perf.lags import VersionHistory

if TYPE_CHECKING:
    from pipelinerl_fsdp.perf.lengths import Lengths

_DRAW = 1 << 15  # lengths drawn at once


class World:
    """What the engines and the trainer share: the clock's events, the groups, the send queues' order, the push."""

    cfg: Any

    def __init__(self, cfg: Any, costs: Any, lengths: Lengths, rng: np.random.Generator) -> None:
        self.cfg, self.costs, self.lengths, self.rng = cfg, costs, lengths, rng
        self.events: list[tuple[float, int, str, int, int]] = []  # (time, order, kind, engine, token)
        self._order = 0
        self.history = VersionHistory(cfg.engines)
        self.outbox: deque[tuple[int, int]] = deque()  # (engine, group) queued to send, oldest first
        # groups, by index: engine, step of the first token, version at admission, completion lengths, trained
        # tokens (prompt + completion, summed over attempts), their squares summed, attempts still running
        self.g_engine: list[int] = []
        self.g_step: list[int] = []
        self.g_version: list[int] = []
        self.g_lengths: list[np.ndarray] = []
        self.g_tokens: list[int] = []
        self.g_sq: list[int] = []
        self.g_left: list[int] = []
        self._drawn = np.zeros(0, dtype=np.int64)
        self._next = 0
        self.push_active = False
        self.push_version = self.push_start = self.push_joined = 0
        colocated = cfg.mode == "colocated"
        push = costs.push
        # colocated: no broadcast; the weight copy is the pause and the trainer waits for it (training/colocated.py)
        self.transfer_s = (push.load_s() if colocated else push.transfer_s()) if push else 0.0
        self.load_s = 0.0 if colocated or push is None else push.load_s()
        per_round = cfg.sync_every * cfg.batch_size // cfg.attempts
        n = cfg.engines
        self.engines = [EngineSim(self, i, per_round // n + (i < per_round % n)) for i in range(n)]

    def schedule(self, t: float, kind: str, who: int, token: int = 0) -> None:
        self._order += 1
        heapq.heappush(self.events, (t, self._order, kind, who, token))

    def draw(self, n: int) -> np.ndarray:
        """The next `n` completion lengths (cut at max_new_tokens)."""
        if self._next + n > len(self._drawn):
            fresh = self.lengths.sample(self.rng, max(_DRAW, n))
            cap = self.cfg.max_new_tokens or None
            self._drawn = np.clip(np.concatenate([self._drawn[self._next :], fresh]), 1, cap).astype(np.int64)
            self._next = 0
        out = self._drawn[self._next : self._next + n]
        self._next += n
        return out

    def new_group(self, engine: int, step: int, version: int, lengths: np.ndarray) -> int:
        p = self.cfg.prompt_tokens
        total = lengths + p
        self.g_engine.append(engine)
        self.g_step.append(step)
        self.g_version.append(version)
        self.g_lengths.append(lengths)
        self.g_tokens.append(int(total.sum()))
        self.g_sq.append(int((total * total).sum()))
        self.g_left.append(len(lengths))
        return len(self.g_left) - 1

    # ---- the weight push: one collective over every engine ----
    def start_push(self, now: float, version: int) -> None:
        self.push_active, self.push_version, self.push_start, self.push_joined = True, version, now, 0
        for e in self.engines:
            e.header(now)

    def joined(self, now: float) -> None:
        self.push_joined += 1
        if self.push_joined == len(self.engines):  # the slowest engine is in: the bytes flow
            self.schedule(max(now, self.push_start) + self.transfer_s, "push_end", -1)

    def engine_event(self, now: float, kind: str, who: int, token: int) -> None:
        if kind == "boundary":
            self.engines[who].boundary(now, token)
        elif kind == "loaded":
            self.engines[who].loaded(now)
        elif kind == "push_end":
            self.push_active = False
            for e in self.engines:
                e.push_end(now)
            self.push_done(now)
        self.pump(now)

    def pump(self, now: float) -> None:  # the data path (simulate.py)
        raise NotImplementedError

    def push_done(self, now: float) -> None:  # the trainer (simulate.py)
        raise NotImplementedError

    def snapshot(self, now: float) -> tuple[float, ...]:
        """Engine counters summed over the engines at `now`: busy, sequence-seconds, paused, send-blocked, idle
        seconds, generated tokens."""
        return tuple(map(sum, zip(*(e.counters(now) for e in self.engines))))


class EngineSim:
    """One engine: its live sequences (count, summed context, a heap of finish steps) and its loop's state."""

    def __init__(self, world: World, index: int, quota: int) -> None:
        self.w, self.i, self.quota = world, index, quota
        cfg = world.cfg
        self.mode, self.attempts, self.slots, self.prompt = cfg.mode, cfg.attempts, cfg.slots, cfg.prompt_tokens
        self.prefill_each = cfg.prompt_tokens * (1 if cfg.prefix_cache else cfg.attempts)
        self.decode_while_blocked = cfg.decode_while_blocked
        self.cap = cfg.send_queue_groups + 1  # the queue and the group its sender thread holds
        self.cost = world.costs.decode
        self.t = 0.0  # the state below holds at t (the start of the current run of steps)
        self.steps = 0  # steps taken
        self.n = 0
        self.kv = 0
        self.prefill = 0  # prompt tokens the next step prefills
        self.finish: list[tuple[int, int, int]] = []  # (step at whose boundary it ends, context then, group)
        self.running = False
        self.target = 0
        self.token = 0
        self.version = 0
        self.paused = False
        self.backlog: deque[int] = deque()
        self.queued = 0  # groups in the send queue
        self.round_left = quota
        self.staged: int | None = None
        self.join_pending = False
        self.updates = 0
        # counters, accrued up to `mark`
        self.mark = 0.0
        self.busy = self.seq_s = self.paused_s = self.blocked_s = self.active_s = 0.0
        self.gen = 0

    # ---- counters ----
    def _acc(self, now: float) -> None:
        dt = now - self.mark
        if dt > 0:
            blocked = bool(self.backlog)
            if self.running:
                self.busy += dt
                self.seq_s += self.n * dt
            if self.paused:
                self.paused_s += dt
            if blocked:
                self.blocked_s += dt
            if self.running or self.paused or blocked:
                self.active_s += dt
        self.mark = now

    def counters(self, now: float) -> tuple[float, ...]:
        self._acc(now)
        gen = self.gen
        if self.running and now > self.t:  # the steps of the current run done by now
            gen += self.n * max(self.cost.steps_within(now - self.t, self.n, self.kv, self.prefill) - 1, 0)
        return self.busy, self.seq_s, self.paused_s, self.blocked_s, now - self.active_s, gen

    # ---- running ----
    def start(self, now: float) -> None:
        self.admit(now)
        self.go(now)

    def go(self, now: float) -> None:
        """Run steps until the next finish, when there is anything to run and nothing stops the engine."""
        self._acc(now)
        self.token += 1
        self.t = now
        self.running = self.n > 0 and not self.paused and (not self.backlog or self.decode_while_blocked)
        if self.running:
            k = self.finish[0][0] - self.steps
            self.target = self.steps + k
            self.w.schedule(now + self.cost.steps_s(k, self.n, self.kv, self.prefill), "boundary", self.i, self.token)
        elif self.mode == "async" and self.staged is not None and self.n == 0 and not self.backlog and not self.paused:
            self.apply(now)

    def boundary(self, now: float, token: int) -> None:
        if token != self.token:
            return  # superseded (an update moved the boundary)
        self._acc(now)
        k = self.target - self.steps
        self.gen += self.n * k
        self.steps, self.kv, self.prefill, self.t = self.target, self.kv + self.n * k, 0, now
        self.running = False
        while self.finish and self.finish[0][0] == self.steps:
            _, ctx, g = heapq.heappop(self.finish)
            self.n -= 1
            self.kv -= ctx
            self.w.g_left[g] -= 1
            if self.w.g_left[g] == 0:
                self.group_done(g, now)
        self.proceed(now)

    def proceed(self, now: float) -> None:
        """The loop between two steps: take an update whose header is in, or load a staged one, else admit."""
        if self.join_pending:
            self.join(now)
        elif self.mode == "async" and self.staged is not None and self.n == 0 and not self.backlog:
            self.apply(now)
        else:
            self.admit(now)
            self.go(now)

    def admit(self, now: float) -> None:
        if self.paused or self.backlog:
            return
        self._acc(now)
        w = self.w
        while self.n + self.attempts <= self.slots:
            if self.mode == "async" and self.staged is not None:
                return
            if self.mode in ("conventional", "colocated"):
                if self.round_left <= 0:
                    return
                self.round_left -= 1
            lengths = w.draw(self.attempts)
            g = w.new_group(self.i, self.steps, self.version, lengths)
            for n_tok in lengths.tolist():
                heapq.heappush(self.finish, (self.steps + n_tok, self.prompt + n_tok, g))
            self.n += self.attempts
            self.kv += self.attempts * self.prompt
            self.prefill += self.prefill_each

    # ---- sending ----
    def group_done(self, g: int, now: float) -> None:
        if not self.backlog and self.queued < self.cap:
            self.queued += 1
            self.w.outbox.append((self.i, g))
        else:
            self._acc(now)
            self.backlog.append(g)

    def sent(self, now: float) -> None:
        """The oldest group of this engine's send queue has left it."""
        self.queued -= 1
        if not self.backlog:
            return
        self._acc(now)
        self.queued += 1
        self.w.outbox.append((self.i, self.backlog.popleft()))
        if self.backlog or self.paused:
            return
        if not self.running:
            self.proceed(now)  # the loop was waiting to send: it goes on
        else:
            self.stop_at_next_boundary(now)  # vLLM ran on meanwhile: the loop admits before its next step

    # ---- updates ----
    def header(self, now: float) -> None:
        """A push has started: join it at the next step boundary (at once when not stepping)."""
        self.join_pending = True
        if self.paused:
            return  # still loading the previous update: joins when it resumes
        if not self.running:
            self.join(now)
        else:
            self.stop_at_next_boundary(now)

    def stop_at_next_boundary(self, now: float) -> None:
        """Something for the loop arrived while the engine steps: take it at the first step boundary from `now`."""
        k = self.cost.steps_within(now - self.t, self.n, self.kv, self.prefill)
        if k == 0:
            self.running = False
            self.proceed(now)
        elif self.steps + k < self.target:
            self.token += 1
            self.target = self.steps + k
            self.w.schedule(
                self.t + self.cost.steps_s(k, self.n, self.kv, self.prefill), "boundary", self.i, self.token
            )

    def join(self, now: float) -> None:
        self._acc(now)
        self.join_pending, self.paused, self.running = False, True, False
        self.token += 1
        self.w.joined(now)

    def push_end(self, now: float) -> None:
        """The bytes are in: load them (pipeline, conventional, colocated) or keep them staged (async)."""
        if self.mode == "async":
            self._acc(now)
            self.paused, self.staged = False, self.w.push_version
            self.proceed(now)
        else:
            self.w.schedule(now + self.w.load_s, "loaded", self.i)

    def apply(self, now: float) -> None:
        """Async: drained with an update staged: load it."""
        self._acc(now)
        self.paused, self.running = True, False
        self.token += 1
        self.w.schedule(now + self.w.load_s, "loaded", self.i)

    def loaded(self, now: float) -> None:
        self._acc(now)
        self.paused = False
        self.version = self.staged if self.mode == "async" else self.w.push_version
        self.staged = None
        self.w.history.begin(self.i, self.steps, self.version)
        self.updates += 1
        self.round_left = self.quota if self.mode in ("conventional", "colocated") else self.round_left
        self.proceed(now)
