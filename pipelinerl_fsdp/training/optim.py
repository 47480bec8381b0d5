"""AdamW and the learning-rate schedule (linear warm-up, then cosine decay or constant), from an OptimizerConfig."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from pipelinerl_fsdp.config import OptimizerConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(
    params: Iterable[torch.nn.Parameter], opt: OptimizerConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and its schedule over `total_steps` optimizer steps."""
    optimizer = torch.optim.AdamW(
        list(params), lr=opt.lr, betas=(opt.betas[0], opt.betas[1]), eps=opt.eps, weight_decay=opt.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, opt.warmup_steps, total_steps, opt.lr_schedule, opt.min_lr_ratio)
    )
    return optimizer, scheduler
