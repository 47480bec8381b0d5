"""AdamW and the learning-rate schedule (linear warm-up, then cosine decay or constant)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[torch.nn.Parameter], lr: float, betas: list[float], eps: float,
                    weight_decay: float, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(list(params), lr=lr, betas=(betas[0], betas[1]), eps=eps, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, warmup_steps, total_steps, schedule, min_ratio))
    return opt, sched
