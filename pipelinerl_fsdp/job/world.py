"""The torchrun world: device, backend, threads and process groups, created once at start-up in a fixed order."""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipelinerl_fsdp.config import Config, ConfigError, InferenceConfig, JobConfig, WorldConfig
from pipelinerl_fsdp.engine_kinds import engine_kind
from pipelinerl_fsdp.runtime.gpus import gpu_count
from pipelinerl_fsdp.transport.store_group import store_prefix


@dataclass
class World:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    trainer_ranks: list[int]
    inference_ranks: list[int]
    trainer_group: dist.ProcessGroup | None  # FSDP collectives (trainer ranks only)
    trainer_mesh: DeviceMesh | None
    # first trainer rank + every inference rank; one group per purpose, each used from one thread only
    weight_group: dist.ProcessGroup | None
    rollout_group: dist.ProcessGroup | None

    @property
    def is_inference(self) -> bool:
        return self.rank in self.inference_ranks

    @property
    def inference_index(self) -> int:
        return self.inference_ranks.index(self.rank)

    @property
    def is_trainer(self) -> bool:
        return self.rank in self.trainer_ranks

    @property
    def trainer_rank(self) -> int:
        """Index of this rank among the trainer ranks (data-parallel rank)."""
        return self.trainer_ranks.index(self.rank)

    @property
    def is_main(self) -> bool:
        """The one rank that writes metrics and files."""
        return self.rank == self.trainer_ranks[0]


def rank_layout(world_size: int, n_inference: int) -> tuple[list[int], list[int]]:
    """(trainer ranks, inference ranks): trainers take the low ranks (some torch state-dict helpers keep results on
    global rank 0 only), engines the highest `n_inference`."""
    return list(range(world_size - n_inference)), list(range(world_size - n_inference, world_size))


def job_backend(world: WorldConfig, job: JobConfig) -> str:
    """The backend of the trainers' collectives, one decision for the whole job (from the machine, not the rank's
    role): every rank must build the same groups. Asked of NVML, so that no rank initialises CUDA here."""
    if world.backend != "auto":
        return world.backend
    return "nccl" if job.device != "cpu" and gpu_count() > 0 else "gloo"


def uses_cuda(job: JobConfig, inference: InferenceConfig, backend: str, is_inference: bool) -> bool:
    """Whether this rank's own process computes on a GPU. Trainers do in an NCCL job. An inference rank does only
    when its engine runs in this process (the reference engine) and `inference.device` lets it; a vLLM rank stays
    on CPU (its engine's processes take the GPUs) and must never initialise CUDA before vLLM starts them."""
    if backend != "nccl":
        return False
    if not is_inference:
        return True
    if job.stage != "rl":
        return False  # an inference rank of the warm-start stage only waits
    return not engine_kind(inference).own_processes and inference.device == "auto"


def group_backends(backend: str, inference_on_cuda: bool) -> dict[str, str]:
    """Backend of each process group. The default group (every rank) is gloo, so CPU-only ranks can join it: with
    NCCL there, or a `device_id` on it, torch creates the NCCL communicator eagerly over all ranks at start-up and
    CPU-only ranks never join (a certain hang). Trainer collectives use NCCL on GPU, with gloo beside it for the CPU
    tensors of the sample scatter. The weight group carries the buckets only for in-process engines: NCCL when
    those are on GPU, else gloo (with vLLM it carries only the update headers). Rollouts are CPU data: gloo."""
    both = "cpu:gloo,cuda:nccl"
    return {
        "default": "gloo",
        "trainer": both if backend == "nccl" else "gloo",
        "weight": both if inference_on_cuda else "gloo",
        "rollout": "gloo",
    }


def init_world(cfg: Config) -> World:
    """Join the torchrun job (or run as a single process without torchrun) and build the process groups."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    n_inf = cfg.world.inference_ranks
    if n_inf >= world_size:
        raise ConfigError(
            f"world.inference_ranks = {n_inf} leaves no trainer rank: the job has {world_size} rank(s) in all"
        )
    trainer_ranks, inference_ranks = rank_layout(world_size, n_inf)
    backend = job_backend(cfg.world, cfg.job)
    if backend == "nccl" and cfg.job.device == "cpu":
        raise ConfigError("world.backend = 'nccl' needs CUDA devices, but job.device = 'cpu'")
    if backend != "nccl" and cfg.job.device == "cuda":
        why = "world.backend = 'gloo'" if cfg.world.backend == "gloo" else "no GPU is visible on this node"
        raise ConfigError(f"job.device = 'cuda' but {why}")
    on_cuda = uses_cuda(cfg.job, cfg.inference, backend, rank in inference_ranks)
    inference_on_cuda = uses_cuda(cfg.job, cfg.inference, backend, True)
    device = _cuda_device(cfg.job, local_rank) if on_cuda else torch.device("cpu")
    threads = cfg.job.threads_per_rank or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(threads)
    if "MASTER_ADDR" not in os.environ:  # plain `python run_train.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        os.environ.update(RANK="0", WORLD_SIZE="1")
    backends = group_backends(backend, inference_on_cuda)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.world.timeout_s)
        # no device_id: it would make torch connect NCCL eagerly over every rank, CPU-only ones included
        dist.init_process_group(
            backends["default"],
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            store=_attempt_store(rank, world_size, timeout),
        )
    # Every rank creates every group, in the same order, even those it is not part of (non-members get no
    # backend object, so a CPU-only rank never constructs an NCCL one). A member's device_id connects NCCL now,
    # among the trainers only: a trainer that cannot reach the others fails here, named, not at its first step.
    trainer_group = dist.new_group(
        trainer_ranks,
        backend=backends["trainer"],
        device_id=device if rank in trainer_ranks and on_cuda else None,
        # NCCL's own default is 10 minutes whatever world.timeout_s says (gloo groups keep torch's default)
        timeout=datetime.timedelta(seconds=cfg.world.timeout_s) if backend == "nccl" else None,
    )
    weight_group = rollout_group = None
    if inference_ranks:
        members = [trainer_ranks[0], *inference_ranks]
        weight_group = dist.new_group(members, backend=backends["weight"])
        rollout_group = dist.new_group(members, backend=backends["rollout"])
    mesh = None
    if rank in trainer_ranks:
        mesh = DeviceMesh.from_group(trainer_group, device.type, mesh_dim_names=("dp",))
    return World(
        rank,
        world_size,
        local_rank,
        local_world_size,
        device,
        backend,
        trainer_ranks,
        inference_ranks,
        trainer_group,
        mesh,
        weight_group,
        rollout_group,
    )


def _cuda_device(job: JobConfig, local_rank: int) -> torch.device:
    """This rank's GPU (the one of its local rank); only ranks that compute on a GPU get here."""
    if not torch.cuda.is_available():
        raise ConfigError(f"job.device = {job.device!r} but CUDA is not available on this machine")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"local rank {local_rank} needs a GPU of its own, but this node has {torch.cuda.device_count()} "
            "(run one process per GPU: torchrun --nproc-per-node)"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """The default group's store, under this attempt's prefix. torchrun keeps one store for the whole job, also
    across restarts (`--max-restarts`): without the prefix a restarted rank reads the dead attempt's addresses and
    fails to connect. Under torchrun its agent hosts the store; a plain `python run_train.py` hosts it on rank 0."""
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent and rank == 0,
        timeout=timeout,
    )
    return dist.PrefixStore(f"{store_prefix()}default/", store)


def job_flags(timeout_s: float) -> dist.Store:
    """A client of the job's TCPStore (torchrun's, at MASTER_ADDR:MASTER_PORT) for one-off flags between ranks."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.PrefixStore(f"{store_prefix()}flags/", store)


def wait_for_flag(store: dist.Store, key: str, failed_key: str, poll_s: float = 0.2) -> None:
    """Wait until `key` is set on the job's store, in short checks: a blocking `store.wait` holds off Python's
    signal handlers for its whole length, so torchrun's SIGTERM (sent to the survivors when a rank fails) would go
    unanswered until its SIGKILL 30 s later. Where `failed_key` is set instead (a peer failed first), raise with
    the cause it wrote, so every rank ends within `poll_s` of the first failure and says why."""
    while True:
        if store.check([failed_key]):
            raise RuntimeError(
                f"a peer failed before setting {key!r}: {store.get(failed_key).decode(errors='replace')}"
            )
        if store.check([key]):
            return
        time.sleep(poll_s)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def waiting_for(what: str, rank: int) -> Iterator[None]:
    """Name what a blocking exchange with other ranks was waiting for when it fails: a peer died (connection
    reset) or `world.timeout_s` passed. torch's own errors say neither the stage nor what was missing."""
    try:
        yield
    except RuntimeError as e:  # gloo / NCCL errors (DistBackendError is a RuntimeError)
        raise RuntimeError(f"rank {rank}, waiting for {what}: {type(e).__name__}: {e}") from e
