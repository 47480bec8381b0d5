"""The torchrun world: device, backend, threads and process groups, created once at start-up in a fixed order."""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from pipelinerl_fsdp.config import Config, ConfigError
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
    control_group: dist.ProcessGroup | None  # every rank, gloo: barriers that CPU-only ranks join too

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


def _pick_device(cfg: Config, local_rank: int) -> torch.device:
    want = cfg.job.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"job.device = 'cuda' but CUDA is not available on this machine ({cfg.source})")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def job_backend(cfg: Config) -> str:
    """The collective backend, one decision for the whole job (from the machine, not the rank's role): a CPU-only
    inference rank on a GPU node must pick the same backend as the trainers, or the ranks create different groups
    (only NCCL jobs add the gloo control group) and hang."""
    if cfg.world.backend != "auto":
        return cfg.world.backend
    return "nccl" if cfg.job.device != "cpu" and torch.cuda.is_available() else "gloo"


def _engine_in_own_processes(cfg: Config, rank: int, world_size: int) -> bool:
    """An inference rank whose engine runs in processes of its own (vLLM): the rank's process stays on CPU, the
    engine's processes take the accelerators."""
    from pipelinerl_fsdp.inference.factory import engine_kind

    is_inference = rank >= world_size - cfg.world.inference_ranks
    return cfg.job.stage == "rl" and is_inference and engine_kind(cfg).own_processes


def init_world(cfg: Config) -> World:
    """Join the torchrun job (or run as a single process without torchrun) and build the trainer group."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    from pipelinerl_fsdp.inference.factory import engine_kind

    engines_own_processes = cfg.job.stage == "rl" and engine_kind(cfg).own_processes
    cpu_only = _engine_in_own_processes(cfg, rank, world_size)
    device = torch.device("cpu") if cpu_only else _pick_device(cfg, local_rank)
    threads = cfg.job.threads_per_rank or max(1, (os.cpu_count() or 1) // local_world_size)
    torch.set_num_threads(threads)
    backend = job_backend(cfg)
    if backend == "nccl" and device.type != "cuda" and not cpu_only:
        raise ConfigError(f"world.backend = 'nccl' needs CUDA devices; this rank runs on {device} ({cfg.source})")
    if "MASTER_ADDR" not in os.environ:  # plain `python run_train.py`: a world of one
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29512"))
        os.environ.update(RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.world.timeout_s)
        # nccl for the trainers' collectives, gloo for CPU-only ranks (vLLM inference ranks, the rollout group)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
            store=_attempt_store(rank, world_size, timeout),
        )
    n_inf = cfg.world.inference_ranks
    if n_inf >= world_size:
        raise ConfigError(
            f"world.inference_ranks = {n_inf} leaves no trainer rank: the job has {world_size} "
            f"rank(s) in all ({cfg.source})"
        )
    # Trainers take the low ranks: some torch state-dict helpers keep results on global rank 0 only.
    trainer_ranks = list(range(world_size - n_inf))
    inference_ranks = list(range(world_size - n_inf, world_size))
    # Every rank creates every group, in the same order, even those it is not part of.
    trainer_group = dist.new_group(trainer_ranks)
    control_group = dist.new_group(list(range(world_size)), backend="gloo") if backend == "nccl" else None
    weight_group = rollout_group = None
    if inference_ranks:
        members = [trainer_ranks[0], *inference_ranks]
        # engines in their own processes: only the update headers travel here (the buckets go straight to the
        # engine's workers), and the inference rank is CPU-only: gloo
        weight_group = dist.new_group(members, backend="gloo" if engines_own_processes else None)
        rollout_group = dist.new_group(members, backend="gloo")  # rollouts are CPU data, even with NCCL
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
        control_group,
    )


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
