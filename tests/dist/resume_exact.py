"""torchrun script (2 FSDP ranks): train k steps on fixed batches, checkpoint, take step k+1; then restore the
checkpoint into fresh model/optimizer/scheduler and take the same step k+1: same loss, same weights after it.
With `lora`: the same with LoRA adapters (fp32) on a frozen base stored in bf16 (as a GPU stores it), FSDP2 over
both; the checkpoint holds the adapters and their optimizer state only.

Run: torchrun --nproc-per-node 2 tests/dist/resume_exact.py OUTPUT_DIR [lora]
"""

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from pipelinerl_fsdp.checkpoint_layout import latest_checkpoint
from pipelinerl_fsdp.training.checkpoint import load_checkpoint, save_checkpoint
from pipelinerl_fsdp.config import LoRAConfig, OptimizerConfig
from pipelinerl_fsdp.configure import load_config
from pipelinerl_fsdp.models import build_model, flavour_args
from pipelinerl_fsdp.models.lora import apply_lora, init_adapters
from pipelinerl_fsdp.training.optim import build_optimizer
from pipelinerl_fsdp.training.policy import frozen_base_dtype
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


LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"])


def fresh(world, lora: bool):
    model = build_model(ARGS, seed=0)
    if lora:
        apply_lora(model, LORA)
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(frozen_base_dtype(LORA, torch.bfloat16))
    apply_fsdp(model, world.trainer_mesh, torch.bfloat16 if lora else torch.float32, torch.float32)
    if lora:
        init_adapters(model, seed=0)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt, sched = build_optimizer(trained, OptimizerConfig(lr=1e-3, weight_decay=0.01, warmup_steps=2), 10)
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
    out, lora = Path(sys.argv[1]), sys.argv[2:] == ["lora"]
    world = init_world(load_config(["--job.threads_per_rank=1"]))
    model, opt, sched = fresh(world, lora)
    base = {n: p.full_tensor().clone() for n, p in model.named_parameters() if not p.requires_grad}
    for k in range(3):
        step(model, opt, sched, world, k)
    save_checkpoint(out, 3, model, opt, sched, {"version": 3}, world.trainer_group, world.is_main)
    loss_a = step(model, opt, sched, world, 3)
    weights_a = full_state_dict(model)

    if lora:  # only what trains was saved: the adapters and their AdamW moments
        saved = set(dcp.FileSystemReader(str(latest_checkpoint(out))).read_metadata().state_dict_metadata)
        tensors = {k for k in saved if not k.startswith("optim.param_groups.")}
        assert tensors and all(".lora_" in k for k in tensors), sorted(tensors)[:5]
        assert any(k.startswith("optim.state.") for k in saved) and any(k.startswith("model.") for k in saved)
        assert all(torch.equal(p.full_tensor(), base[n]) for n, p in model.named_parameters() if n in base)
        assert any(p.full_tensor().abs().max() > 0 for n, p in model.named_parameters() if ".lora_B." in n)
    model, opt, sched = fresh(world, lora)
    meta = load_checkpoint(latest_checkpoint(out), model, opt, sched, world.trainer_group)
    assert meta["version"] == 3 and meta["step"] == 3
    loss_b = step(model, opt, sched, world, 3)
    weights_b = full_state_dict(model)
    assert loss_a == loss_b, (loss_a, loss_b)
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    if world.is_main:
        print(f"RESUME_EXACT_OK loss={loss_a} lora={lora}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
