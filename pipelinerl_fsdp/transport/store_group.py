"""A process group outside torchrun's default world, built on the job's TCPStore.

vLLM's workers live in processes that vLLM spawns (engine core, tensor-parallel workers), not in the torchrun
world, and an engine must not adopt the default group (it deadlocks: docs/vllm.md). The first trainer rank and
those workers instead meet here: every member connects to the store that torchrun already serves at
MASTER_ADDR:MASTER_PORT, under a prefix of its own, and builds a gloo (CPU) or NCCL (GPU) group with explicit
ranks. Collectives then go through the group object itself (`group.broadcast([t], opts)`), since it is not
registered with `torch.distributed`'s default world.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


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


def join_store_group(
    host: str, port: int, name: str, rank: int, size: int, backend: str, device: torch.device, timeout_s: float
) -> dist.ProcessGroup:
    """Join group `name` as `rank` of `size`; blocks until every member has joined (or `timeout_s`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"{store_prefix()}{name}/", dist.TCPStore(host, port, is_master=False, timeout=timeout))
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        if device.type != "cuda":
            raise ValueError(f"store group {name!r}: NCCL needs a CUDA device, got {device}")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
        # NCCL connects lazily; a first tiny broadcast makes the join a real rendezvous, as with gloo.
        group.broadcast([torch.zeros(1, device=device)], dist.BroadcastOptions()).wait()
        return group
    raise ValueError(f"store group {name!r}: unknown backend {backend!r}")
