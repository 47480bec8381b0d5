"""Waiting for, and timing, transfers and kernels the same way on CPU and GPU.

On gloo a work's `wait()` blocks the host until the data has arrived. On NCCL it does not: it only makes the
caller's CUDA stream wait, so a host clock read after it measures a launch, the real stall moves into whatever
the stream runs next, and an exchange that never completes shows up as a hang there (or as the NCCL watchdog's
abort, which names nothing of ours). Here a GPU wait polls the work to completion against a deadline, and GPU
time is taken from CUDA events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

POLL_S = 1e-4
CHECK_EVERY_S = 1.0  # how often a wait asks its `check` (which may read the store)

# called with the seconds waited so far, at most every CHECK_EVERY_S; raises to end the wait early
Check = Callable[[float], None]


def poll_until(
    done: Callable[[], bool],
    what: str,
    timeout_s: float,
    poll_s: float = POLL_S,
    check: Check | None = None,
    check_every_s: float | None = None,
) -> None:
    """Return once `done()` is true; a `TimeoutError` naming `what` after `timeout_s`. `check`, when given, is
    called every `check_every_s` (default `CHECK_EVERY_S`) with the time waited so far and may fail the wait sooner,
    with a reason."""
    check_every_s = CHECK_EVERY_S if check_every_s is None else check_every_s
    t0 = time.monotonic()
    deadline, next_check = t0 + timeout_s, t0 + check_every_s
    while not done():
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{what}: not complete after {timeout_s:.0f} s (world.timeout_s)")
        if check is not None and now >= next_check:
            check(now - t0)
            next_check = now + check_every_s
        time.sleep(poll_s)


def wait_on_host(
    work: Any,
    device: torch.device,
    what: str,
    timeout_s: float,
    poll_s: float = POLL_S,
    check: Check | None = None,
    check_every_s: float | None = None,
) -> None:
    """Block until `work` (a `dist.Work`, or a work with `wait`/`is_completed`) has completed on the device, at
    most `timeout_s`; past that a `TimeoutError` names `what`. CPU works (gloo) wait as they are, unless a
    `check` (see `poll_until`) needs the wait polled."""
    if device.type != "cuda":
        if check is not None:  # gloo's wait blocks in C++: poll it (at most 0.5 ms late, little CPU), then wait
            poll_until(work.is_completed, what, timeout_s, max(poll_s, 5e-4), check, check_every_s)
        work.wait()
        return
    order_after = getattr(work, "order_after", None)
    if order_after is not None:  # a transfer on a stream of its own, whose `wait()` polls without the check
        poll_until(work.is_completed, what, timeout_s, poll_s, check, check_every_s)
        order_after()
        return
    work.wait()  # orders the caller's stream after the transfer (and raises an error NCCL already knows of)
    poll_until(work.is_completed, what, timeout_s, poll_s, check, check_every_s)


def free_for_reuse(work: Any, device: torch.device, what: str, timeout_s: float, check: Check | None = None) -> None:
    """Before a buffer that `work` reads takes new data. A transfer on a CUDA stream of its own (`order_after`:
    `store_group.EventWork`) orders the caller's stream after it, on the device, without blocking the host: what
    writes the buffer next runs once the transfer has read it, and a later host wait (`wait_on_host`) catches a
    transfer that never completes. A torch NCCL work's `wait()` orders the stream too; a gloo work's blocks the
    host (against `timeout_s`, with `check`, as `wait_on_host`)."""
    order_after = getattr(work, "order_after", None)
    if order_after is not None:
        order_after()
    elif device.type == "cuda":
        work.wait()
    else:
        wait_on_host(work, device, what, timeout_s, check=check)


class Stopwatch:
    """Sums the time of the blocks run under `with stopwatch:`. On CPU the host clock; on GPU a pair of CUDA events
    per block on the current stream, read (one synchronisation) when `seconds()` is asked."""

    def __init__(self, device: torch.device) -> None:
        self.on_device = device.type == "cuda"
        self._host_s = 0.0
        self._events: list[tuple[Any, Any]] = []
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:
        if self.on_device:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events.append((start, None))
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on_device:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events[-1] = (self._events[-1][0], end)
        else:
            self._host_s += time.perf_counter() - self._t0

    def seconds(self) -> float:
        if not self.on_device:
            return self._host_s
        if self._events:
            self._events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in self._events) / 1000
