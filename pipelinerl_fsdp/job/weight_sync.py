"""The layout of the weight sync, decided once for the job and handed to both ends (the trainer's sender, the
engine factory): where the engines compute, in what dtype the weights travel, who receives the buckets."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipelinerl_fsdp.config import InferenceConfig, JobConfig, LoRAConfig
from pipelinerl_fsdp.engine_kinds import engine_kind
from pipelinerl_fsdp.job.world import World, uses_cuda


def engine_dtype(name: str, device: torch.device) -> torch.dtype:
    """dtype of the engines' weights (and of the weight broadcast), `inference.dtype`: bf16 on GPU, fp32 on CPU
    unless set."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@dataclass(frozen=True)
class WeightSyncLayout:
    """How the weights travel from the first trainer rank to the engines, one decision for both ends."""

    # the engines compute on a GPU: the buckets then travel over NCCL from the trainer's GPU
    engines_on_gpu: bool
    # dtype of the engines' weights and of the broadcast
    dtype: torch.dtype
    # the engine's own worker processes receive the buckets (vLLM), in a group of the first trainer rank and
    # every engine's workers; else the inference rank's process receives them on the job's weight group
    workers_join: bool
    # members of that bucket group: the first trainer rank + every engine's GPUs (or CPU workers)
    bucket_group_size: int
    # the adapters that travel instead of the whole model (`[lora]` on); None: the full weights
    lora: LoRAConfig | None = None

    @property
    def push_dtype(self) -> torch.dtype:
        """dtype of the pushed tensors: the engines' for full weights; fp32 for adapters (a few MB), which the
        engines merge into their weights themselves, in their dtype, from the trainer's exact values."""
        return torch.float32 if self.lora is not None else self.dtype

    def bucket_device(self, trainer_device: torch.device) -> torch.device:
        """Where the first trainer rank gathers the buckets: its GPU when they travel over NCCL, else CPU (gathered
        on the GPU and copied out bucket by bucket)."""
        return trainer_device if self.engines_on_gpu else torch.device("cpu")


def weight_sync_layout(
    job: JobConfig, inference: InferenceConfig, world: World, lora: LoRAConfig | None = None
) -> WeightSyncLayout:
    """The weight sync's layout for this job: where the engines compute, in what dtype, who receives the buckets,
    and whether adapters travel instead of the weights (`lora` enabled)."""
    kind = engine_kind(inference)
    on_gpu = world.backend == "nccl" and (kind.own_processes or uses_cuda(job, inference, world.backend, True))
    return WeightSyncLayout(
        engines_on_gpu=on_gpu,
        dtype=engine_dtype(inference.dtype, torch.device("cuda" if on_gpu else "cpu")),
        workers_join=kind.own_processes,
        bucket_group_size=1 + len(world.inference_ranks) * inference.gpus_per_engine,
        lora=lora if lora is not None and lora.enabled else None,
    )
