"""Where an engine runs and in what dtype: the cores or GPUs of an inference rank's vLLM engine.

torchrun gives each node's ranks contiguous global ranks, and the job puts trainers on the low ranks, so on a
node the trainer ranks come first. On GPU every trainer rank uses the GPU of its local rank; the node's vLLM
engines take the GPUs after those, `tensor_parallel_size` each, in local-rank order. On CPU each rank owns an
equal slice of the node's cores (the trainers through torch's thread count, the engines by binding vLLM's
OpenMP threads to their slice, counted from the top core down; an oversubscribed node, e.g. tests with more
ranks than cores, shares cores and says so).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pipelinerl_fsdp.config import Config, ConfigError
from pipelinerl_fsdp.world import World


@dataclass
class VLLMPlacement:
    """Where an engine runs: CPU cores for vLLM's OpenMP threads, or GPU indices (one per tensor-parallel rank)."""

    cpu_cores: str | None  # VLLM_CPU_OMP_THREADS_BIND value, e.g. "1" or "0-3|4-7"; None: vLLM's own choice
    gpu_ids: list[int] | None  # CUDA_VISIBLE_DEVICES of the engine; None on CPU


def engine_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """dtype of the engines' weights (and of the weight broadcast): bf16 on GPU, fp32 on CPU unless set."""
    name = cfg.inference.dtype
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def vllm_placement(cfg: Config, world: World) -> VLLMPlacement:
    """Cores (CPU) or GPU indices (GPU) of this inference rank's vLLM engine."""
    inf = cfg.inference
    node_first = world.rank - world.local_rank
    local_trainers = sum(1 for r in world.trainer_ranks if node_first <= r < node_first + world.local_world_size)
    if world.backend == "nccl":
        tp = inf.tensor_parallel_size
        first = local_trainers + (world.local_rank - local_trainers) * tp
        ids = list(range(first, first + tp))
        if ids[-1] >= torch.cuda.device_count():
            raise ConfigError(
                f"rank {world.rank}: its vLLM engine needs GPUs {ids} (inference.tensor_parallel_size "
                f"= {tp}, after the node's {local_trainers} trainer GPU(s)), but the node has "
                f"{torch.cuda.device_count()} ({cfg.source})"
            )
        return VLLMPlacement(cpu_cores=None, gpu_ids=ids)
    n_cpu = os.cpu_count() or 1
    per = min(n_cpu, inf.cpu_cores_per_engine or cfg.job.threads_per_rank or max(1, n_cpu // world.local_world_size))
    # engines from the top core down (trainers' threads are not bound; they start from the bottom)
    first = max(0, n_cpu - (world.local_rank - local_trainers + 1) * per)
    if world.local_world_size * per > n_cpu:
        print(
            f"[rank {world.rank}] warning: {world.local_world_size} ranks x {per} core(s) on a {n_cpu}-core node: "
            f"oversubscribed; this engine shares cores {first}-{first + per - 1}",
            flush=True,
        )
    tp = inf.tensor_parallel_size
    if per % tp:
        raise ConfigError(
            f"inference.cpu_cores_per_engine = {per} is not a multiple of "
            f"inference.tensor_parallel_size = {tp} ({cfg.source})"
        )
    step = per // tp
    cores = "|".join(f"{first + i * step}-{first + (i + 1) * step - 1}" for i in range(tp))
    return VLLMPlacement(cpu_cores=cores, gpu_ids=None)
