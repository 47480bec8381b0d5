"""CPU jobs: which of the node's cores each rank owns, and binding the rank (and every process it starts) to them.

On a CPU node the engines and the trainers compete for the same cores; without binding the OS moves vLLM's engine
core, our client thread and the trainer's threads across all of them (measured before this module: the trainer's
step took 0.24 s in pipeline mode against 0.19 s in conventional mode on 2 cores). The split: each local vLLM
engine takes `per_engine` cores from the top core down (its OpenMP threads are bound inside that slice, see
`inference/placement.py`), the local trainer ranks share the cores below, in equal contiguous slices. The binding
is the CPU affinity of every thread of the process (gloo's I/O loops included), which every thread and child
started later inherits: vLLM's engine core and workers, reward workers.
GPU jobs are not bound (their CPUs feed the GPUs; the layout there is the cluster's business).
"""

from __future__ import annotations

import functools
import os


@functools.cache
def node_cores() -> tuple[int, ...]:
    """The cores this job may use on this node: the process's affinity when first asked (before any binding)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS): all of them
        return tuple(range(os.cpu_count() or 1))


def engine_slice(cores: tuple[int, ...], engine_index: int, per_engine: int) -> list[int]:
    """The cores of the node's `engine_index`-th engine (0: the top slice); the lowest slice is reused when the
    engines need more cores than the node has (oversubscribed)."""
    n = len(cores)
    top = max(per_engine, n - engine_index * per_engine)
    return list(cores[max(0, top - per_engine) : top])


def trainer_slice(
    cores: tuple[int, ...], trainer_index: int, n_trainers: int, n_engines: int, per_engine: int
) -> list[int] | None:
    """The cores of the node's `trainer_index`-th trainer rank: an equal contiguous share of the cores the engines
    leave; None when there are fewer left than trainers (the node is oversubscribed: nothing is bound)."""
    left = len(cores) - n_engines * per_engine
    if n_trainers == 0 or left < n_trainers:
        return None
    share = left // n_trainers
    first = trainer_index * share
    last = left if trainer_index == n_trainers - 1 else first + share  # the last takes the remainder
    return list(cores[first:last])


def _thread_ids() -> set[int]:
    """This process's threads (Linux: /proc/self/task); {0}, the calling thread, where there is no /proc."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return {0}


def bind(cores: list[int]) -> bool:
    """Bind this process (every thread it runs now, and the threads and processes it starts from now on) to
    `cores`; False where the OS cannot.

    Linux's affinity is per thread: `sched_setaffinity(0)` binds only the calling thread, and threads already
    running keep theirs. By the time a rank binds (after the warm start) torch.distributed has started gloo's
    I/O loops for the job's process groups; left on every core, an inference rank's loop ran on the trainer's core
    and the trainer's own loop (the rollouts in, the weight pushes out: ~8% of a core) could land on the
    engine's. So every thread is bound; passes repeat until no new thread appears (one started meanwhile by a
    thread not yet bound would keep the old affinity)."""
    want = set(cores)
    seen: set[int] = set()
    try:
        for _ in range(10):
            tids = _thread_ids()
            if tids <= seen:
                break
            for tid in sorted(tids - seen):
                try:
                    os.sched_setaffinity(tid, want)
                except ProcessLookupError:  # the thread ended meanwhile
                    pass
            seen |= tids
    except (AttributeError, OSError):
        return False
    return True
