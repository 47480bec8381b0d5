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


def test_adamw_is_fused_only_when_every_parameter_is_on_cuda():
    from pipelinerl_fsdp.training.optim import use_fused_adamw

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert use_fused_adamw([cuda, torch.device("cuda", 1)])
    assert not use_fused_adamw([cuda, cpu]) and not use_fused_adamw([cpu]) and not use_fused_adamw([])
    opt, _ = build_optimizer([torch.nn.Parameter(torch.zeros(2))], OptimizerConfig(), total_steps=10)
    assert not opt.param_groups[0]["fused"]  # CPU parameters: torch's default path, as before


def test_a_dtensor_parameter_is_placed_by_its_local_shard():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from pipelinerl_fsdp.training.optim import param_device

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)]))
        assert param_device(p) == torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_fused_adamw_takes_the_same_steps_as_the_default_path():
    """torch's fused AdamW (the GPU choice; CPU has the kernel too) against the path CPU runs use: 5 steps on the
    same gradients agree within 1e-6 relative (float32; the two order the update's terms differently)."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(16, 8, generator=g), torch.randn(8, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in start] for _ in range(5)]
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0)
    final = []
    for fused in (True, False):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt, sched = build_optimizer(params, cfg, total_steps=10, fused=fused)
        assert bool(opt.param_groups[0]["fused"]) == fused
        for step in grads:
            for p, gr in zip(params, step):
                p.grad = gr.clone()
            opt.step()
            sched.step()
        final.append([p.detach() for p in params])
    for a, b, s in zip(*final, start):
        assert not torch.equal(a, s)  # the steps moved the parameters
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
