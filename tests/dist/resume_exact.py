"""torchrun script (2 FSDP ranks): train k steps on fixed batches, checkpoint, take step k+1; then restore the
checkpoint into fresh model/optimizer/scheduler and take the same step k+1: same loss, same weights after it.

Run: torchrun --nproc-per-node 2 tests/dist/resume_exact.py OUTPUT_DIR
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from pipelinerl_fsdp.checkpoint_layout import latest_checkpoint
from pipelinerl_fsdp.training.checkpoint import load_checkpoint, save_checkpoint
from pipelinerl_fsdp.config import OptimizerConfig
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.training.optim import build_optimizer
from pipelinerl_fsdp.training.parallelize import apply_fsdp, full_state_dict
from pipelinerl_fsdp.rl.loss import policy_loss
from pipelinerl_fsdp.rl.objectives.reinforce_tis import ReinforceTISConfig
from pipelinerl_fsdp.training.train_step import clip_and_step, forward_backward
from pipelinerl_fsdp.rl.batching import rl_micro_batches
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.job.world import init_world

ARGS = flavour_args("debug", vocab_size=30)


def batch(step: int, rank: int) -> list[Sample]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    out = []
    for i in range(4):
        n = int(torch.randint(2, 9, (1,), generator=g))
        comp = torch.randint(0, 30, (n,), generator=g).tolist()
        out.append(Sample(i, [3, 4, 5], comp, (-torch.rand(n, generator=g)).tolist(), [0] * n, 0.0,
                          float(torch.randn(1, generator=g))))
    return out


def fresh(world):
    model = build_model(ARGS, seed=0)
    apply_fsdp(model, world.trainer_mesh, torch.float32, torch.float32)
    opt, sched = build_optimizer(model.parameters(), OptimizerConfig(lr=1e-3, weight_decay=0.01, warmup_steps=2), 10)
    return model, opt, sched


def step(model, opt, sched, world, k: int) -> float:
    micro = rl_micro_batches(batch(k, world.rank), 64, torch.device("cpu"))
    losses = []

    def loss_fn(logp, ent, mb):
        x = mb.loss_input
        loss, _ = policy_loss(logp[0], replace(x, weight=x.mask / 8), ReinforceTISConfig())
        losses.append(float(loss))
        return loss * 2, {}

    forward_backward(model, micro, loss_fn, 1.0, world.trainer_group, torch.device("cpu"))
    clip_and_step(model, opt, sched, 1.0)
    t = torch.tensor([sum(losses)])
    dist.all_reduce(t, group=world.trainer_group)
    return float(t)


def main() -> None:
    out = Path(sys.argv[1])
    world = init_world(load_config(["--job.threads_per_rank=1"]))
    model, opt, sched = fresh(world)
    for k in range(3):
        step(model, opt, sched, world, k)
    save_checkpoint(out, 3, model, opt, sched, {"version": 3}, world.trainer_group, world.is_main)
    loss_a = step(model, opt, sched, world, 3)
    weights_a = full_state_dict(model)

    model, opt, sched = fresh(world)
    meta = load_checkpoint(latest_checkpoint(out), model, opt, sched, world.trainer_group)
    assert meta["version"] == 3 and meta["step"] == 3
    loss_b = step(model, opt, sched, world, 3)
    weights_b = full_state_dict(model)
    assert loss_a == loss_b, (loss_a, loss_b)
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    if world.is_main:
        print(f"RESUME_EXACT_OK loss={loss_a}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
