"""CPU jobs: which of the node's cores each rank owns, and binding the rank (and every process it starts) to them.

On a CPU node the engines and the trainers compete for the same cores; without binding the OS moves vLLM's engine
core, our client thread and the trainer's threads across all of them (measured before this module: the trainer's
step took 0.24 s in pipeline mode against 0.19 s in conventional mode on 2 cores). The split: each local vLLM
engine takes `per_engine` cores from the top core down (its OpenMP threads are bound inside that slice, see
`inference/placement.py`), the local trainer ranks share the cores below, in equal contiguous slices. The binding
is the process's CPU affinity, which every child inherits: vLLM's engine core and workers, reward workers.
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


def bind(cores: list[int]) -> bool:
    """Bind this process (and the processes it starts from now on) to `cores`; False where the OS cannot."""
    try:
        os.sched_setaffinity(0, cores)
    except (AttributeError, OSError):
        return False
    return True
