"""AdamW and the learning-rate schedule (linear warm-up, then cosine decay or constant), from an OptimizerConfig."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from pipelinerl_fsdp.config import OptimizerConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak LR at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant" or total_steps <= warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def param_device(p: torch.Tensor) -> torch.device:
    """Where a parameter's values live: a DTensor's (FSDP2's sharded parameter) local shard's device."""
    return p.to_local().device if isinstance(p, DTensor) else p.device


def use_fused_adamw(devices: Iterable[torch.device]) -> bool:
    """Whether AdamW runs fused (one kernel per group of parameters instead of the foreach path's several
    kernels per update term): when every parameter is on CUDA. FSDP2's DTensor parameters can take the fused
    kernel: torch registers `aten._fused_adamw_` as a pointwise op of DTensor (torch/distributed/tensor/_ops/
    _pointwise_ops.py, "fused optimizer ops", read in the installed 2.13; torch 2.11, the lent GPU's, is exercised by
    the GPU check's `step` parts, which build this optimizer), so each rank updates its own shard. Elsewhere torch's
    default stays (foreach on GPU, one tensor at a time on CPU): what the CPU tests and results were measured with
    (fused exists on CPU too, equal to it within float rounding: tests/unit/training/test_optim.py)."""
    devices = list(devices)
    return bool(devices) and all(d.type == "cuda" for d in devices)


def build_optimizer(
    params: Iterable[torch.nn.Parameter], opt: OptimizerConfig, total_steps: int, fused: bool | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` and its schedule over `total_steps` optimizer steps; fused where `use_fused_adamw` says
    (`fused` given: as it says), else torch's default implementation."""
    params = list(params)
    if fused is None:
        fused = use_fused_adamw(param_device(p) for p in params)
    optimizer = torch.optim.AdamW(
        params,
        lr=opt.lr,
        betas=(opt.betas[0], opt.betas[1]),
        eps=opt.eps,
        weight_decay=opt.weight_decay,
        fused=True if fused else None,  # None: torch picks foreach or single-tensor by device
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, opt.warmup_steps, total_steps, opt.lr_schedule, opt.min_lr_ratio)
    )
    return optimizer, scheduler
