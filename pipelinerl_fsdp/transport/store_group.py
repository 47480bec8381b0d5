"""A process group outside torchrun's default world, built on the job's TCPStore.

vLLM's workers live in processes that vLLM spawns (engine core, tensor-parallel workers), not in the torchrun
world, and an engine must not adopt the default group (it deadlocks: docs/vllm.md). The first trainer rank and
those workers instead meet here: every member connects to the store that torchrun already serves at
MASTER_ADDR:MASTER_PORT, under a prefix of its own, and builds a gloo group (CPU) or vLLM's NCCL communicator
(GPU) with explicit ranks. Broadcasts go through the group object (`group.broadcast(flat)`), since it is not
registered with `torch.distributed`'s default world.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_fsdp.transport.device_waits import poll_until

# the group of the first trainer rank and the vLLM workers that receive the weight buckets
ENGINE_BUCKET_GROUP = "vllm_weights"


def store_address() -> tuple[str, int]:
    """The torchrun store's (host, port), from the environment torchrun sets on every rank."""
    try:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as e:
        raise RuntimeError(f"{e.args[0]} is not set: store-built groups need a torchrun job") from None


def store_prefix() -> str:
    """Key prefix of this job attempt in the torchrun store: the store outlives a restart (`--max-restarts`), and
    keys left by the failed attempt (group addresses, flags) must not be read by the next one."""
    return f"pipelinerl/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


class StoreGroup:
    """A broadcast group outside torchrun's world, rank 0 the source. `broadcast` returns a work whose `wait()`
    blocks this host until the transfer is complete (or fails after the group's time-out, naming the group)."""

    def __init__(self, name: str, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.name, self.rank, self.size, self.device, self.timeout_s = name, rank, size, device, timeout_s

    def broadcast(self, flat: torch.Tensor) -> Any:
        raise NotImplementedError


class GlooStoreGroup(StoreGroup):
    """CPU tensors over gloo; gloo's `wait()` blocks the host, and fails after the time-out."""

    def __init__(self, store: dist.Store, name: str, rank: int, size: int, timeout_s: float) -> None:
        super().__init__(name, rank, size, torch.device("cpu"), timeout_s)
        self.pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))

    def broadcast(self, flat: torch.Tensor) -> dist.Work:
        return self.pg.broadcast([flat], dist.BroadcastOptions())  # root: rank 0


class EventWork:
    """A transfer queued on a CUDA stream. `wait()` blocks the host until it has run, polling its event against a
    deadline (an NCCL exchange that never completes raises here, with the group's name, instead of stalling the
    stream forever), then orders the caller's stream after it."""

    def __init__(
        self, event: torch.cuda.Event, device: torch.device, what: str, timeout_s: float, poll_s: float = 1e-4
    ) -> None:
        self.event, self.device, self.what, self.timeout_s, self.poll_s = event, device, what, timeout_s, poll_s

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> bool:
        poll_until(self.is_completed, self.what, self.timeout_s, self.poll_s)
        torch.cuda.current_stream(self.device).wait_event(self.event)
        return True


class PyNcclStoreGroup(StoreGroup):
    """GPU tensors over vLLM's own NCCL communicator (`PyNcclCommunicator` on a `StatelessProcessGroup`): the way
    vLLM's workers take part in a group outside vLLM's world, as PipelineRL, OpenRLHF and verl do for weight sync;
    a torch `ProcessGroupNCCL` inside vLLM's worker process is untested ground. Both ends use this class: the
    first trainer rank (rank 0) and every vLLM worker. Broadcasts run on a stream of their own, after the work
    already queued on the caller's stream (the bucket's gather)."""

    def __init__(self, store: dist.Store, name: str, rank: int, size: int, device: torch.device, timeout_s: float):
        if device.type != "cuda":
            raise ValueError(f"store group {name!r}: NCCL needs a CUDA device, got {device}")
        super().__init__(name, rank, size, device, timeout_s)
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        # vLLM's group is a dataclass around any c10d store: ours (the torchrun store, under our prefix), so no
        # rank has to open a port of its own; the communicator's set-up is the rendezvous (it blocks until all join)
        self.pg = StatelessProcessGroup(rank=rank, world_size=size, store=store)
        caller_stream = torch.cuda.current_stream(device)
        self.comm = PyNcclCommunicator(self.pg, device=device)
        # its warm-up asks vLLM's `current_stream()`, which in a process that never set one (the trainer) switches
        # this thread to a new stream for good (its set-up synchronised that stream): give the caller's back
        torch.cuda.set_stream(caller_stream)
        self.stream = torch.cuda.Stream(device=device)

    def broadcast(self, flat: torch.Tensor) -> EventWork:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.comm.broadcast(flat, src=0, stream=self.stream)
            flat.record_stream(self.stream)  # the caller's allocator must not hand this memory out mid-transfer
            event = torch.cuda.Event()
            event.record(self.stream)
        what = f"weight bucket on group {self.name!r} (rank {self.rank} of {self.size})"
        return EventWork(event, self.device, what, self.timeout_s)


def join_store_group(
    host: str,
    port: int,
    name: str,
    rank: int,
    size: int,
    backend: str,
    device: torch.device,
    timeout_s: float,
    prefix: str | None = None,
) -> StoreGroup:
    """Join group `name` as `rank` of `size`; blocks until every member has joined (or `timeout_s`). `prefix`: the
    job attempt's key prefix (default: this process's `store_prefix()`; vLLM's processes are given it, since they
    do not see torchrun's environment). gloo on CPU; "nccl" on GPU goes through vLLM's own NCCL communicator."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = store_prefix() if prefix is None else prefix
    store = dist.PrefixStore(f"{prefix}{name}/", dist.TCPStore(host, port, is_master=False, timeout=timeout))
    if backend == "gloo":
        return GlooStoreGroup(store, name, rank, size, timeout_s)
    if backend == "nccl":
        return PyNcclStoreGroup(store, name, rank, size, device, timeout_s)
    raise ValueError(f"store group {name!r}: unknown backend {backend!r}")
