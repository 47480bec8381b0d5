"""The learning-rate schedule and the optimizer built from an OptimizerConfig."""

from __future__ import annotations

import math

import pytest
import torch

from pipelinerl_fsdp.config import OptimizerConfig
from pipelinerl_fsdp.training.optim import build_optimizer, lr_factor


def test_warmup_is_linear_then_cosine_reaches_the_floor():
    f = [lr_factor(s, 4, 20, "cosine", 0.1) for s in range(25)]
    assert f[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    assert f[4] == pytest.approx(1.0)  # the peak right after warm-up
    assert all(a >= b for a, b in zip(f[4:], f[5:]))  # monotone decay
    assert f[12] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f[20] == pytest.approx(0.1) and f[24] == pytest.approx(0.1)  # floor, also past the end


def test_constant_schedule_after_warmup():
    assert [lr_factor(s, 2, 10, "constant", 0.1) for s in range(5)] == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])


def test_build_optimizer_uses_every_field():
    p = torch.nn.Parameter(torch.zeros(3))
    opt, sched = build_optimizer(
        [p],
        OptimizerConfig(lr=0.5, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.1, warmup_steps=1, lr_schedule="constant"),
        total_steps=10,
    )
    g = opt.param_groups[0]
    assert (g["betas"], g["eps"], g["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.1)
    assert sched.get_last_lr()[0] == pytest.approx(0.25)  # warm-up step 0 of 1
    opt.step()
    sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(0.5)


def test_a_non_finite_gradient_applies_nothing():
    from pipelinerl_fsdp.training.train_step import clip_and_step

    model = torch.nn.Linear(2, 1)
    opt, sched = build_optimizer(model.parameters(), OptimizerConfig(lr=0.1, warmup_steps=0), total_steps=10)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(1, 2)).sum().mul(float("nan")).backward()
    norm = clip_and_step(model, opt, sched, 1.0)
    assert math.isnan(norm) and sched.last_epoch == 0  # the schedule did not move
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # the NaN gradients are gone
    model(torch.ones(1, 2)).sum().backward()
    assert math.isfinite(clip_and_step(model, opt, sched, 1.0)) and sched.last_epoch == 1
