"""Typed job configuration, owned by its sections.

- `job.py`, `training.py`, `inference.py`, `task.py`, `lora.py`: the sections, each a dataclass with its keys and the
  checks of their values (`check()`) next to them. A task, a loss and an engine extend their section with a
  class of their own, registered beside them (`task.name`, `loss.name`, `inference.engine` select it).
- `schema.py`: `Config`, one field per TOML section.
- `parse.py`: TOML files layered in order, `--section.key=value` overrides, the resolved config written back.
- `rules.py`: the cross-key rules.
- `errors.py`: `ConfigError`; the loader appends where the values came from, once.

Depends on nothing else of the package. Roles take the sections they read, not the whole `Config`.
"""

from pipelinerl_fsdp.config.errors import ConfigError, check_choice, failed
from pipelinerl_fsdp.config.inference import EvalConfig, InferenceConfig
from pipelinerl_fsdp.config.job import (
    GPU_KINDS,
    CheckpointConfig,
    JobConfig,
    MetricsConfig,
    ModelConfig,
    PlanConfig,
    TokenizerConfig,
    WorldConfig,
)
from pipelinerl_fsdp.config.lora import LORA_TARGETS, LoRAConfig
from pipelinerl_fsdp.config.parse import (
    MOVED_KEYS,
    REPO_CONFIG_DIR,
    check_sections,
    parse_config,
    parse_overrides,
    resolve_config_path,
    save_resolved,
    to_toml,
)
from pipelinerl_fsdp.config.rules import check_rules
from pipelinerl_fsdp.config.schema import Config, sections
from pipelinerl_fsdp.config.task import TaskConfig
from pipelinerl_fsdp.config.training import (
    LossConfig,
    Normalization,
    OptimizerConfig,
    RLConfig,
    TrainerConfig,
    WarmstartConfig,
)

__all__ = [
    "LORA_TARGETS",
    "MOVED_KEYS",
    "REPO_CONFIG_DIR",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "EvalConfig",
    "InferenceConfig",
    "JobConfig",
    "LoRAConfig",
    "LossConfig",
    "MetricsConfig",
    "ModelConfig",
    "Normalization",
    "OptimizerConfig",
    "PlanConfig",
    "GPU_KINDS",
    "RLConfig",
    "TaskConfig",
    "TokenizerConfig",
    "TrainerConfig",
    "WarmstartConfig",
    "WorldConfig",
    "check_choice",
    "check_rules",
    "check_sections",
    "failed",
    "parse_config",
    "parse_overrides",
    "resolve_config_path",
    "save_resolved",
    "sections",
    "to_toml",
]
