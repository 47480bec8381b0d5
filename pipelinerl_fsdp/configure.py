"""Load the job's configuration: the schema and its own checks (`config.py`, which depends on nothing of ours),
then the keys backed by a registry (task, model flavour, engine, weight load, loss) checked against it, and the
checks that need the world size."""

from __future__ import annotations

import importlib.util
import sys

from pipelinerl_fsdp.config import Config, ConfigError, check_choice, parse_config
from pipelinerl_fsdp.inference.kinds import ENGINE_KINDS, engine_kind
from pipelinerl_fsdp.inference.vllm_load import LOADS
from pipelinerl_fsdp.models.args import FLAVOURS
from pipelinerl_fsdp.rl.objectives import CONFIGS as LOSS_CONFIGS
from pipelinerl_fsdp.tasks import TASKS


def load_config(argv: list[str] | None = None) -> Config:
    """`[--config PATH_OR_NAME] [--section.key=value ...]` -> validated Config. Overrides win over the file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = parse_config(argv, {n: t.config_class for n, t in TASKS.items()}, LOSS_CONFIGS)
    check_registered(cfg)
    return cfg


def check_registered(cfg: Config) -> None:
    """Every registry-backed key names an entry of its registry."""
    src = cfg.source
    check_choice("inference.engine", cfg.inference.engine, ENGINE_KINDS, src)
    check_choice("inference.vllm_weight_load", cfg.inference.vllm_weight_load, ("auto", *LOADS), src)
    if not cfg.model.path:
        check_choice("model.flavour", cfg.model.flavour, FLAVOURS, src)


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the torchrun world size."""
    if cfg.world.inference_ranks >= world_size:
        raise ConfigError(
            f"world.inference_ranks = {cfg.world.inference_ranks} leaves no trainer rank: the job "
            f"has {world_size} rank(s) in all ({cfg.source})"
        )
    trainers = world_size - cfg.world.inference_ranks
    if cfg.job.stage == "rl" and cfg.world.inference_ranks < 1:
        raise ConfigError(f"job.stage = 'rl' needs world.inference_ranks >= 1 ({cfg.source})")
    if cfg.job.stage == "rl":
        kind = engine_kind(cfg)
        if kind.own_processes and cfg.inference.device != "auto":
            raise ConfigError(
                f"inference.device = {cfg.inference.device!r} applies to an engine in the inference rank's own "
                f"process; {cfg.inference.engine!r} picks its device by its build ({cfg.source})"
            )
        if kind.package and importlib.util.find_spec(kind.package) is None:
            raise ConfigError(
                f"inference.engine = {cfg.inference.engine!r} but {kind.package} is not installed: "
                f"{kind.install_hint} ({cfg.source})"
            )
    if cfg.warmstart.batch_size % trainers:
        raise ConfigError(
            f"warmstart.batch_size = {cfg.warmstart.batch_size} must be a multiple of the number "
            f"of trainer ranks ({trainers}) ({cfg.source})"
        )
