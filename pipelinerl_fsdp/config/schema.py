"""The whole job's configuration: one field per TOML section."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from pipelinerl_fsdp.config.inference import EvalConfig, InferenceConfig
from pipelinerl_fsdp.config.job import (
    CheckpointConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    PlanConfig,
    TokenizerConfig,
    WorldConfig,
)
from pipelinerl_fsdp.config.lora import LoRAConfig
from pipelinerl_fsdp.config.task import TaskConfig
from pipelinerl_fsdp.config.training import LossConfig, RLConfig, TrainerConfig, WarmstartConfig


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # replaced by the selected task's own config class (a TaskConfig subclass) when the config is loaded
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # replaced by the selected engine's own config class (an InferenceConfig subclass) when the config is loaded
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    # replaced by the selected loss's own config class (a LossConfig subclass) when the config is loaded
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # where the values came from, for error messages (not a TOML section)
    source: str = field(default="defaults", metadata={"internal": True})


def sections() -> dict[str, type]:
    """The TOML sections: name -> the schema's class of that section (a variant may replace it by a subclass)."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if not f.metadata.get("internal")}
