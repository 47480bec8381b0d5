"""The keys every task has (`[task]`); a task's own config class extends them (pipelinerl_fsdp/tasks/)."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl_fsdp.config.errors import failed


@dataclass
class TaskConfig:
    """Keys every task has; a task's `config_class` (pipelinerl_fsdp/tasks/) extends it with its own."""

    name: str = "addition"
    # held-out evaluation split: size and seed (fixed problems, disjoint from training problems)
    eval_size: int = 500
    eval_seed: int = 1234
    # generation budget per completion (tokens, EOS included)
    max_new_tokens: int = 8

    def check(self) -> list[tuple[str, str]]:
        """(key, what it must be) for every impossible value; empty when the values are fine."""
        return failed(
            [("eval_size", self.eval_size >= 1, ">= 1"), ("max_new_tokens", self.max_new_tokens >= 1, ">= 1")]
        )
