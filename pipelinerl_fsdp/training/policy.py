"""The trained policy of either stage (warm start, RL): the model sharded with FSDP2, AdamW and its schedule,
built by one function so that both stages shard, cast and optimise the same way."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pipelinerl_fsdp.config import LoRAConfig, OptimizerConfig, TrainerConfig
from pipelinerl_fsdp.job.world import World
from pipelinerl_fsdp.models import Transformer
from pipelinerl_fsdp.models.hf_io import load_shards_into, read_model_args
from pipelinerl_fsdp.models.lora import apply_lora, init_adapters
from pipelinerl_fsdp.training.optim import build_optimizer
from pipelinerl_fsdp.training.parallelize import (
    DTYPES,
    apply_activation_checkpointing,
    apply_compile,
    apply_fsdp,
    resolve_compile,
    resolve_fp32_head,
    resolve_param_dtype,
)
from pipelinerl_fsdp.training.train_step import clip_and_step


@dataclass
class Policy:
    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self) -> float:
        """Clip, optimizer and schedule step, zero the gradients; returns the pre-clip global gradient norm."""
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.grad_clip)


def _parallelize(model: Transformer, world: World, trainer: TrainerConfig) -> Transformer:
    assert world.trainer_mesh is not None, "only trainer ranks shard the policy"
    param_dtype = resolve_param_dtype(trainer.param_dtype, world.device)
    apply_activation_checkpointing(model, trainer.activation_checkpointing, trainer.ac_every)
    if resolve_compile(trainer.compile, world.device):
        apply_compile(model)
    return apply_fsdp(
        model,
        world.trainer_mesh,
        param_dtype,
        DTYPES[trainer.reduce_dtype],
        resolve_fp32_head(trainer.fp32_head, param_dtype),
    )


def shard(model: Transformer, world: World, trainer: TrainerConfig) -> Transformer:
    """FSDP2 over the trainer ranks with the configured mixed precision (the model on this rank's device)."""
    return _parallelize(model.to(world.device), world, trainer)


def frozen_base_dtype(lora: LoRAConfig | None, param_dtype: torch.dtype) -> torch.dtype:
    """How the base weights are stored on the trainer: fp32 master weights when they train; frozen under LoRA, in
    the dtype they compute in (bf16 on a GPU: 2 bytes a parameter instead of 4, and no cast per gather). The
    adapters stay fp32 either way: FSDP2 checks one dtype only across a unit's trainable parameters."""
    return param_dtype if lora is not None and lora.enabled else torch.float32


def adapt(model: Transformer, lora: LoRAConfig, param_dtype: torch.dtype) -> None:
    """LoRA on a built, unsharded model (on the meta device or materialised): adapters on the targeted linears
    (`apply_lora`), everything else frozen and stored in `frozen_base_dtype`. The adapters still need
    `init_adapters` once the model is sharded and materialised."""
    apply_lora(model, lora)
    base = frozen_base_dtype(lora, param_dtype)
    for p in model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(base)


def load_sharded(
    folder: str | Path, world: World, trainer: TrainerConfig, lora: LoRAConfig | None = None, seed: int = 0
) -> Transformer:
    """The model of an HF folder, built on the meta device, sharded, then filled shard by shard from the files:
    each rank allocates and reads only its own shard of every parameter (a 7B model never sits whole in any
    rank's memory, host or GPU). With `lora` enabled the targeted linears get adapters (PEFT's initial values,
    seeded by `seed`) and everything else is frozen, stored in `frozen_base_dtype`."""
    with torch.device("meta"):
        model = Transformer(read_model_args(folder))
    if lora is not None and lora.enabled:
        adapt(model, lora, resolve_param_dtype(trainer.param_dtype, world.device))
    _parallelize(model, world, trainer)
    model.to_empty(device=world.device)
    load_shards_into(model, folder)
    if lora is not None and lora.enabled:
        init_adapters(model, seed)
        model.base_folder = str(folder)  # type: ignore[attr-defined]  # the frozen base a checkpoint must match
    return model


def build_policy(model: Transformer, opt: OptimizerConfig, total_steps: int) -> Policy:
    """AdamW + schedule over `total_steps` optimizer steps for a model sharded by `shard` or `load_sharded`: over
    the parameters that train (all of them, or the adapters under LoRA)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(trained, opt, total_steps)
    return Policy(model, optimizer, scheduler, opt.grad_clip)
