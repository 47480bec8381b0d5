"""Load the job's configuration: the schema and its own checks (`config/`, which depends on nothing of ours), with
the sections that registries extend (task, loss, engine) selected from their registries, the keys backed by a
registry (model flavour) checked against it, and the checks that need the world size."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pipelinerl_fsdp.config import Config, ConfigError, check_choice, parse_config
from pipelinerl_fsdp.engine_kinds import engine_configs, engine_kind
from pipelinerl_fsdp.models.args import FLAVOURS
from pipelinerl_fsdp.rl.objectives import CONFIGS as LOSS_CONFIGS
from pipelinerl_fsdp.tasks import TASKS


def load_config(argv: list[str] | None = None) -> Config:
    """`[--config PATH_OR_NAME] [--section.key=value ...]` -> validated Config. Overrides win over the file."""
    argv = list(sys.argv[1:] if argv is None else argv)
    variants = {
        "task.name": {n: t.config_class for n, t in TASKS.items()},
        "loss.name": LOSS_CONFIGS,
        "inference.engine": engine_configs(),
    }
    cfg = parse_config(argv, variants)
    with named_source(cfg.source):
        if not cfg.model.path:
            check_choice("model.flavour", cfg.model.flavour, FLAVOURS)
    return cfg


@contextmanager
def named_source(source: str) -> Iterator[None]:
    """`with named_source(cfg.source):` a `ConfigError` raised inside leaves naming where the values came from (the
    files, the command line): the boundary appends it once, so the code that finds a problem needs only its
    sections."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(f"{e} ({source})") from None


def validate_world(cfg: Config, world_size: int) -> None:
    """Checks that need the torchrun world size."""
    if cfg.world.inference_ranks >= world_size:
        raise ConfigError(
            f"world.inference_ranks = {cfg.world.inference_ranks} leaves no trainer rank: the job "
            f"has {world_size} rank(s) in all"
        )
    trainers = world_size - cfg.world.inference_ranks
    if cfg.job.stage == "rl" and cfg.world.inference_ranks < 1:
        raise ConfigError("job.stage = 'rl' needs world.inference_ranks >= 1")
    if cfg.job.stage == "rl":
        kind = engine_kind(cfg.inference)
        if kind.own_processes and cfg.inference.device != "auto":
            raise ConfigError(
                f"inference.device = {cfg.inference.device!r} applies to an engine in the inference rank's own "
                f"process; {cfg.inference.engine!r} picks its device by its build"
            )
        if kind.package and importlib.util.find_spec(kind.package) is None:
            raise ConfigError(
                f"inference.engine = {cfg.inference.engine!r} but {kind.package} is not installed: {kind.install_hint}"
            )
    if cfg.warmstart.batch_size % trainers:
        raise ConfigError(
            f"warmstart.batch_size = {cfg.warmstart.batch_size} must be a multiple of the number "
            f"of trainer ranks ({trainers})"
        )
