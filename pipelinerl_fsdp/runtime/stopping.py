"""SIGTERM / SIGINT: stop the job quickly, and let the trainer save the steps it has done since its last checkpoint.

torchrun passes a signal it receives (Ctrl-C, `scancel`, a preemption notice) to every worker's process group and
kills what is left 30 s later. An inference rank (and vLLM's processes, which get the same signal) stops at once:
nothing it holds outlives the job. A trainer rank in graceful mode (`install(graceful=True)`, the RL stage with
`checkpoint.save_on_stop`) only notes the signal: the first trainer rank notices it where the step loop waits for
rollouts, tells the other trainer ranks in place of their next batch, and all of them save a checkpoint of the
last finished step, then exit. A step in progress when the signal comes is finished first unless it needs the
engines (its weight push is dropped). If the checkpoint is not written within `grace_s()`, or a second signal comes,
the rank exits at once; a save cut short is never resumed from (see `checkpoint.py`).

torchrun also sends SIGTERM to the surviving ranks when one fails: a trainer that survives saves its finished
steps the same way, so a restart (`--max-restarts`) loses only what the failed rank's step had not finished.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable


def grace_s() -> float:
    """How long a graceful stop may take: torchrun sends SIGKILL `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` (default 30) s
    after its SIGTERM; stop, with a message, 5 s before that."""
    return max(1.0, float(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30")) - 5.0)


_signal: int | None = None
_noted = threading.Event()


class StopRequested(Exception):
    """Raised where a trainer rank can stop without leaving a step half done."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def requested() -> int | None:
    """The signal that asked this rank to stop, or None."""
    return _signal


def raise_if_requested() -> None:
    if _signal is not None:
        raise StopRequested(_signal)


def explains_failure(wait_s: float = 5.0) -> bool:
    """Whether a failed exchange with other ranks is part of a stop: a signal came, or comes within `wait_s`
    (torchrun signals the ranks one after the other, so a peer may be gone a moment before this rank hears)."""
    return _noted.wait(wait_s)


def install(graceful: bool, on_exit: Callable[[], None]) -> None:
    """Handle SIGTERM and SIGINT. Not graceful: print, run `on_exit` (stop child processes), exit 128 + signal.
    Graceful: note the first signal and start a watchdog that exits like that after `grace_s()`; a second signal
    exits at once."""
    grace = grace_s()

    def exit_now(signum: int, why: str) -> None:
        print(f"[rank {os.environ.get('RANK', '0')}] stopped by signal {signal.Signals(signum).name}{why}", flush=True)
        on_exit()
        os._exit(128 + signum)

    def watchdog(signum: int) -> None:
        time.sleep(grace)
        exit_now(signum, f" (no checkpoint within {grace:.0f} s: the newest complete one stands)")

    def handler(signum: int, frame: object) -> None:
        global _signal
        if not graceful or _signal is not None:
            exit_now(signum, "")
        _signal = signum
        _noted.set()
        threading.Thread(target=watchdog, args=(signum,), daemon=True, name="stop-watchdog").start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
