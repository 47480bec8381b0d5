"""Build this inference rank's engine (of the kind `inference.engine` names, see `kinds.py`) from the job's inputs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pipelinerl_fsdp.config import Config
from pipelinerl_fsdp.inference.kinds import EngineKind, engine_kind

if TYPE_CHECKING:
    from pipelinerl_fsdp.inference.engine import Engine
    from pipelinerl_fsdp.job.world import World
    from pipelinerl_fsdp.job_inputs import JobInputs
    from pipelinerl_fsdp.transport.weights import WeightReceiver


def engine_class(kind: EngineKind) -> type[Engine]:
    """The class `kind.impl` names, imported now (an engine's package loads only when one starts)."""
    module, name = kind.impl.split(":")
    return getattr(importlib.import_module(module), name)


def build_engine(cfg: Config, world: World, inputs: JobInputs, bucket_bytes: int) -> tuple[Engine, WeightReceiver]:
    """Start this inference rank's engine and the receiver of weight updates (collective with the first trainer
    rank where the engine's workers join the bucket group)."""
    import torch

    from pipelinerl_fsdp.inference.engine import EngineSettings
    from pipelinerl_fsdp.inference.placement import engine_dtype

    kind = engine_kind(cfg)
    # an engine in its own processes picks its device itself: the rank's process is on CPU, vLLM's on the GPU
    device = torch.device("cuda" if world.backend == "nccl" else "cpu") if kind.own_processes else world.device
    settings = EngineSettings(
        cfg=cfg,
        world=world,
        model_path=inputs.model_path,
        tokenizer_path=inputs.tokenizer_path,
        max_len=inputs.engine_max_len,
        stop_token_ids=inputs.stop_ids,
        dtype=engine_dtype(cfg, device),
        device=device,
        seed=cfg.job.seed * 1000 + world.rank,
        bucket_bytes=bucket_bytes,
    )
    return engine_class(kind).create(settings)
