"""Entry point: load the config, join the torchrun world, run this job's stage on this rank."""

from __future__ import annotations

import sys
import traceback

from pipelinerl_fsdp.config import Config, ConfigError, load_config, save_resolved, validate_world
from pipelinerl_fsdp.world import init_world, shutdown


def run(cfg: Config) -> None:
    world = init_world(cfg)
    try:
        validate_world(cfg, world.world_size)
        if world.is_main:
            save_resolved(cfg, cfg.job.output_dir)
        if cfg.job.stage == "warmstart":
            from pipelinerl_fsdp.warmstart import run_warmstart

            run_warmstart(cfg, world)
    finally:
        shutdown()


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        run(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    except BaseException:
        # Print the cause with the rank before torchrun tears the other ranks down.
        import os

        print(f"[rank {os.environ.get('RANK', 0)}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        raise
    return 0
