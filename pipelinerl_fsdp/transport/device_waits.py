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


def poll_until(done: Callable[[], bool], what: str, timeout_s: float, poll_s: float = POLL_S) -> None:
    """Return once `done()` is true; a `TimeoutError` naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not complete after {timeout_s:.0f} s (world.timeout_s)")
        time.sleep(poll_s)


def wait_on_host(work: Any, device: torch.device, what: str, timeout_s: float, poll_s: float = POLL_S) -> None:
    """Block until `work` (a `dist.Work`, or a work with `wait`/`is_completed`) has completed on the device, at
    most `timeout_s`; past that a `TimeoutError` names `what`. CPU works (gloo) wait as they are."""
    if device.type != "cuda":
        work.wait()
        return
    work.wait()  # orders the caller's stream after the transfer (and raises an error NCCL already knows of)
    poll_until(work.is_completed, what, timeout_s, poll_s)


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
