"""A process group outside torchrun's default world, built on the job's TCPStore.

vLLM's workers live in processes that vLLM spawns (engine core, tensor-parallel workers), not in the torchrun
world, and an engine must not adopt the default group (it deadlocks: docs/vllm.md). The first trainer rank and
those workers instead meet here: every member connects to the store that torchrun already serves at
MASTER_ADDR:MASTER_PORT, under a prefix of its own, and builds a gloo group (CPU) or vLLM's NCCL communicator
(GPU) with explicit ranks. Broadcasts go through the group object (`group.broadcast(flat)`), since it is not
registered with `torch.distributed`'s default world.

Receiving members mark in the store which bucket of which update they have posted (`mark_posted`), so that a
push stalled on one bucket can name the engines that never asked for it (`transport/stalls.py`).
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

from pipelinerl_fsdp.transport.device_waits import poll_until

# the group of the first trainer rank and the vLLM workers that receive the weight buckets
ENGINE_BUCKET_GROUP = "vllm_weights"
# store key (under the group's prefix) of a receiving member's last posted bucket: "<version> <bucket> <who>"
POSTED_KEY = "posted/"
# what `import vllm` changed in this process's environment and put back (`import_vllm_nccl`): name -> (ours, vLLM's)
VLLM_IMPORT_ENV: dict[str, tuple[str | None, str | None]] = {}


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


def restore_environ(before: dict[str, str]) -> dict[str, tuple[str | None, str | None]]:
    """Put `os.environ` back to `before`; returns what had changed: name -> (value before, value found)."""
    now = dict(os.environ)
    changed = {k: (before.get(k), now.get(k)) for k in before.keys() | now.keys() if before.get(k) != now.get(k)}
    for k, (old, _) in changed.items():
        if old is None:
            del os.environ[k]
        else:
            os.environ[k] = old
    return changed


def import_vllm_nccl() -> tuple[type, type, Callable[[], AbstractContextManager[Any]]]:
    """vLLM's `PyNcclCommunicator`, `StatelessProcessGroup` and `unpinned_nccl_env` (a no-op context where this
    vLLM lacks it), imported without changing this process.

    The first trainer rank is the only trainer rank that imports vLLM (for the bucket group), and `import vllm`
    runs `vllm/env_override.py`, which sets `TORCHINDUCTOR_COMPILE_THREADS=1`, `PYTORCH_NVML_BASED_CUDA_CHECK=1`,
    `TRITON_CACHE_AUTOTUNING=1` and `TILELANG_CLEANUP_TEMP_FILES=1` in `os.environ`, and imports Inductor, whose
    config reads the compile-thread count once, at its import: that rank alone would compile with one thread
    (measured: 2 -> 1 here) and pass vLLM's values to every process it starts. So Inductor's config is imported
    first, from our environment, and the environment is put back after the import (what changed is kept in
    `VLLM_IMPORT_ENV`). In vLLM's own processes (its workers), where vLLM is already imported, nothing changes."""
    if "vllm" in sys.modules:
        return _vllm_nccl()
    import torch._inductor.config  # noqa: F401  (decides its thread count from our environment, not vLLM's)

    before = dict(os.environ)
    try:
        return _vllm_nccl()
    finally:
        VLLM_IMPORT_ENV.update(restore_environ(before))


def _vllm_nccl() -> tuple[type, type, Callable[[], AbstractContextManager[Any]]]:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    try:
        from vllm.utils.nccl import unpinned_nccl_env
    except ImportError:  # a vLLM without NCCL pins: nothing to undo
        unpinned_nccl_env = nullcontext
    return PyNcclCommunicator, StatelessProcessGroup, unpinned_nccl_env


class StoreGroup:
    """A broadcast group outside torchrun's world, rank 0 the source. `broadcast` returns a work whose `wait()`
    blocks this host until the transfer is complete (or fails after the group's time-out, naming the group).
    `store`: the group's prefixed store, where receiving members mark their progress (None: no marks)."""

    def __init__(
        self,
        name: str,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        store: dist.Store | None = None,
        who: str = "",
    ) -> None:
        self.name, self.rank, self.size, self.device, self.timeout_s = name, rank, size, device, timeout_s
        self.store = store
        self.who = who or f"member {rank} of group {name!r}"
        if rank != 0:
            self.mark_posted(-1, -1)  # present before any update, so the source's reads never block

    def broadcast(self, flat: torch.Tensor) -> Any:
        raise NotImplementedError

    def mark_posted(self, version: int, bucket: int) -> None:
        """A receiving member notes that it has posted its receive of `bucket` of `version` (one store write per
        bucket, while the transfer runs)."""
        if self.store is not None:
            self.store.set(f"{POSTED_KEY}{self.rank}", f"{version} {bucket} {self.who}")

    def posted(self) -> dict[int, tuple[int, int, str]]:
        """Every receiving member's last mark: rank -> (version, bucket, who); read by the source when stalled."""
        out: dict[int, tuple[int, int, str]] = {}
        if self.store is None:
            return out
        for r in range(1, self.size):
            key = f"{POSTED_KEY}{r}"
            if not self.store.check([key]):
                out[r] = (-1, -1, f"member {r} of group {self.name!r}")
                continue
            v, b, who = self.store.get(key).decode().split(" ", 2)
            out[r] = (int(v), int(b), who)
        return out


class GlooStoreGroup(StoreGroup):
    """CPU tensors over gloo; gloo's `wait()` blocks the host, and fails after the time-out."""

    def __init__(self, store: dist.Store, name: str, rank: int, size: int, timeout_s: float, who: str = "") -> None:
        self.pg = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=timeout_s))
        super().__init__(name, rank, size, torch.device("cpu"), timeout_s, store, who)

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

    def order_after(self) -> None:
        """Order the caller's stream after the transfer without blocking the host: what reuses the transfer's
        buffer (the next bucket's gather) then runs on the device once the transfer has read it. A transfer that
        never completes is caught by a later `wait()` (the push's `finish`), against the deadline."""
        torch.cuda.current_stream(self.device).wait_event(self.event)


class PyNcclStoreGroup(StoreGroup):
    """GPU tensors over vLLM's own NCCL communicator (`PyNcclCommunicator` on a `StatelessProcessGroup`): the way
    vLLM's workers take part in a group outside vLLM's world, as PipelineRL, OpenRLHF and verl do for weight sync;
    a torch `ProcessGroupNCCL` inside vLLM's worker process is untested ground. Both ends use this class: the
    first trainer rank (rank 0) and every vLLM worker. Broadcasts run on a stream of their own, after the work
    already queued on the caller's stream (the bucket's gather)."""

    def __init__(
        self,
        store: dist.Store,
        name: str,
        rank: int,
        size: int,
        device: torch.device,
        timeout_s: float,
        who: str = "",
    ):
        if device.type != "cuda":
            raise ValueError(f"store group {name!r}: NCCL needs a CUDA device, got {device}")
        communicator, stateless_group, unpinned_nccl_env = import_vllm_nccl()

        # vLLM's group is a dataclass around any c10d store: ours (the torchrun store, under our prefix), so no
        # rank has to open a port of its own; the communicator's set-up is the rendezvous (it blocks until all join)
        self.pg = stateless_group(rank=rank, world_size=size, store=store)
        caller_stream = torch.cuda.current_stream(device)
        # NCCL variables vLLM pinned for its own communicators (`vllm/utils/nccl.py`, `pin_nccl_env`) must not
        # apply to one shared with the trainer, which does not set them (NCCL does not reconcile them: a hang);
        # vLLM's own weight transfer builds its communicators the same way (`weight_transfer/nccl_common.py`)
        with unpinned_nccl_env():
            self.comm = communicator(self.pg, device=device)
        # its warm-up asks vLLM's `current_stream()`, which in a process that never set one (the trainer) switches
        # this thread to a new stream for good (its set-up synchronised that stream): give the caller's back
        torch.cuda.set_stream(caller_stream)
        refuse_disabled(self.comm, name, rank, size)
        self.stream = torch.cuda.Stream(device=device)
        super().__init__(name, rank, size, device, timeout_s, store, who)

    def broadcast(self, flat: torch.Tensor) -> EventWork:
        refuse_disabled(self.comm, self.name, self.rank, self.size)  # `destroy()` disables it too
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.comm.broadcast(flat, src=0, stream=self.stream)
            flat.record_stream(self.stream)  # the caller's allocator must not hand this memory out mid-transfer
            event = torch.cuda.Event()
            event.record(self.stream)
        what = f"weight bucket on group {self.name!r} (rank {self.rank} of {self.size})"
        return EventWork(event, self.device, what, self.timeout_s)


def why_disabled(size: int) -> str:
    """Why vLLM's `PyNcclCommunicator` disabled itself (`distributed/device_communicators/pynccl.py`, its
    constructor: a group of one, `VLLM_DISABLE_PYNCCL`, or an NCCL library that does not load, whose error vLLM
    logs and swallows: it is asked again here)."""
    if size == 1:
        return "a group of one member (vLLM builds no communicator for it)"
    if os.environ.get("VLLM_DISABLE_PYNCCL", "").lower() in ("1", "true"):
        return "VLLM_DISABLE_PYNCCL is set"
    try:
        from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary

        NCCLLibrary()
    except Exception as e:  # noqa: BLE001  (any failure to load is the answer asked for)
        return f"the NCCL library does not load ({type(e).__name__}: {e}; VLLM_NCCL_SO_PATH names another)"
    return "the communicator was destroyed"


def refuse_disabled(comm: Any, name: str, rank: int, size: int) -> None:
    """Fail, naming the group, the rank and why, when vLLM's communicator is disabled: its collectives are then
    no-ops (`if self.disabled: return`), so a push would return at once and the engines keep their old weights."""
    if getattr(comm, "disabled", False) or not getattr(comm, "available", True):
        raise RuntimeError(
            f"store group {name!r}, rank {rank} of {size}: vLLM's NCCL communicator is disabled "
            f"({why_disabled(size)}); its broadcasts would do nothing and the engines would keep their old weights"
        )


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
    who: str = "",
) -> StoreGroup:
    """Join group `name` as `rank` of `size`; blocks until every member has joined (or `timeout_s`). `prefix`: the
    job attempt's key prefix (default: this process's `store_prefix()`; vLLM's processes are given it, since they
    do not see torchrun's environment). gloo on CPU; "nccl" on GPU goes through vLLM's own NCCL communicator.
    `who`: how errors name this member (e.g. "inference rank 3, worker 0")."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = store_prefix() if prefix is None else prefix
    store = dist.PrefixStore(f"{prefix}{name}/", dist.TCPStore(host, port, is_master=False, timeout=timeout))
    if backend == "gloo":
        return GlooStoreGroup(store, name, rank, size, timeout_s, who)
    if backend == "nccl":
        return PyNcclStoreGroup(store, name, rank, size, device, timeout_s, who)
    raise ValueError(f"store group {name!r}: unknown backend {backend!r}")
