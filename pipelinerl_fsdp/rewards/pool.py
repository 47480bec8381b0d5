"""A pool of worker processes that run a reward function with a hard deadline per answer.

The function, `"package.module:function"`, takes `(completion, gold)` and returns a reward or `(reward, outcome)`.
It runs in a worker's main thread (so libraries with signal-based timeouts, such as math-verify, work there), never
on the engine's decode loop: `submit` queues, `poll` returns what is done without waiting. A worker that passes
the deadline is killed and replaced, and that answer's outcome is `timeout`; one that dies (a crash, an
out-of-memory kill) is replaced and the answer's outcome is `error`; an exception inside the function is an `error`
too. The run goes on in every case.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import signal
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pipelinerl_fsdp.rewards.outcomes import OUTCOMES

RewardFn = Callable[[str, str], Any]


def load_reward_function(path: str) -> RewardFn:
    """`"package.module:function"` -> the function (a clear error naming the path otherwise)."""
    module, sep, name = path.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"reward function {path!r}: expected 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {path!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward function {path!r} is not callable")
    return fn


def _as_result(out: Any) -> tuple[float, str]:
    if isinstance(out, tuple):
        reward, outcome = float(out[0]), str(out[1])
        return reward, outcome if outcome in OUTCOMES else "error"
    reward = float(out)
    return reward, "correct" if reward >= 1.0 else "wrong"


def _worker_main(conn: Connection, fn_path: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the job's to handle, not a worker's
    fn = load_reward_function(fn_path)
    # a module may warm itself up (lazy imports, parser tables) before the first deadline starts
    warm_up = getattr(importlib.import_module(fn_path.partition(":")[0]), "warm_up", None)
    if callable(warm_up):
        warm_up()
    conn.send(("ready",))
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent is gone
            return
        if msg is None:
            return
        try:
            reward, outcome = _as_result(fn(*msg))
        except Exception:  # the function's own failure: this answer only
            reward, outcome = 0.0, "error"
        conn.send(("done", reward, outcome))


@dataclass
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    job: tuple[Hashable, float] | None = None  # (key, started at)


class RewardPool:
    def __init__(self, fn_path: str, workers: int = 2, timeout_s: float = 10.0) -> None:
        load_reward_function(fn_path)  # fail here, with the path, not in a worker
        self.fn_path, self.timeout_s = fn_path, timeout_s
        self._ctx = mp.get_context("spawn")  # the inference rank has threads: never fork it
        self._queue: deque[tuple[Hashable, tuple[str, str]]] = deque()
        self._workers = [self._start() for _ in range(workers)]
        self.timeouts = self.crashes = 0

    def _start(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        p = self._ctx.Process(target=_worker_main, args=(child, self.fn_path), daemon=True, name="reward-worker")
        p.start()
        child.close()
        return _Worker(p, parent)

    def _replace(self, i: int) -> None:
        w = self._workers[i]
        if w.process.is_alive():
            w.process.kill()
        w.process.join(timeout=5)
        w.conn.close()
        self._workers[i] = self._start()

    def submit(self, key: Hashable, completion: str, gold: str) -> None:
        self._queue.append((key, (completion, gold)))

    def pending(self) -> int:
        return len(self._queue) + sum(w.job is not None for w in self._workers)

    def poll(self) -> list[tuple[Hashable, float, str]]:
        """Results finished since the last call (never blocks); starts queued answers on idle workers."""
        done: list[tuple[Hashable, float, str]] = []
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            try:
                while w.conn.poll():
                    msg = w.conn.recv()
                    if msg[0] == "ready":
                        w.ready = True
                    elif w.job is not None:
                        done.append((w.job[0], msg[1], msg[2]))
                        w.job = None
            except (EOFError, OSError):
                pass  # died: handled below
            if not w.process.is_alive():
                if w.job is not None:
                    done.append((w.job[0], 0.0, "error"))
                    self.crashes += 1
                self._replace(i)
            elif w.job is not None and now - w.job[1] > self.timeout_s:
                done.append((w.job[0], 0.0, "timeout"))
                self.timeouts += 1
                self._replace(i)
        for w in self._workers:
            if w.ready and w.job is None and self._queue:
                key, args = self._queue.popleft()
                w.conn.send(args)
                w.job = (key, time.monotonic())
        return done

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every worker has started and warmed up (benchmarks: keep start-up out of the timing)."""
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in self._workers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reward workers not ready after {timeout_s} s")
            self.poll()
            time.sleep(0.01)

    def wait_all(self, timeout_s: float) -> list[tuple[Hashable, float, str]]:
        """Poll until nothing is pending (tests, evaluation)."""
        out: list[tuple[Hashable, float, str]] = []
        deadline = time.monotonic() + timeout_s
        while self.pending() and time.monotonic() < deadline:
            out += self.poll()
            time.sleep(0.005)
        return out

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except OSError:
                pass
        for w in self._workers:
            w.process.join(timeout=2)
            if w.process.is_alive():
                w.process.kill()
