"""Entry point: load the config, join the torchrun world, run this job's stage on this rank."""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist

from pipelinerl_fsdp.config import Config, ConfigError, load_config, save_resolved, validate_world
from pipelinerl_fsdp.world import World, init_world, shutdown


def run_rl(cfg: Config, world: World) -> None:
    """Warm start (trainer ranks, if its folder is missing) unless model.path is given, then PipelineRL."""
    from pipelinerl_fsdp.inference.worker import run_inference
    from pipelinerl_fsdp.trainer import run_trainer
    from pipelinerl_fsdp.warmstart import run_warmstart

    path = cfg.model.path
    if not path:
        if world.is_trainer:
            threads = torch.get_num_threads()
            if not cfg.job.threads_per_rank:  # the engines idle meanwhile: let the trainers use their cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) * world.world_size
                                          // (world.local_world_size * len(world.trainer_ranks))))
            run_warmstart(cfg, world)
            torch.set_num_threads(threads)
        path = cfg.warmstart.path
    dist.barrier(group=world.control_group)  # inference ranks wait for the warm-start folder
    bucket = cfg.world.weight_bucket_mb * 1024**2
    if world.is_trainer:
        run_trainer(cfg, world, path, bucket)
    else:
        run_inference(cfg, world, path, bucket)


def run(cfg: Config) -> None:
    world = init_world(cfg)
    validate_world(cfg, world.world_size)
    if world.is_main:
        save_resolved(cfg, cfg.job.output_dir)
    if cfg.job.stage == "warmstart":
        from pipelinerl_fsdp.warmstart import run_warmstart

        if world.is_trainer:
            run_warmstart(cfg, world)
    elif cfg.job.stage == "rl":
        run_rl(cfg, world)
    shutdown()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        run(cfg)
    except BaseException as e:
        # Print the cause with the rank, then exit at once: a clean shutdown could block on collectives or
        # threads that wait for peers, and torchrun tears the other ranks down as soon as this one is gone.
        rank = os.environ.get("RANK", "0")
        if isinstance(e, ConfigError):
            print(f"[rank {rank}] config error: {e}", file=sys.stderr, flush=True)
        else:
            print(f"[rank {rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2 if isinstance(e, ConfigError) else 1)
    return 0
