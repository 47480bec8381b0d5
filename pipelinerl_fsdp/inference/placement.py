"""Where an engine runs and in what dtype: the cores or GPUs of an inference rank's vLLM engine.

torchrun gives each node's ranks contiguous global ranks, and the job puts trainers on the low ranks, so on a
node the trainer ranks come first. On GPU every trainer rank uses the GPU of its local rank; the node's vLLM
engines take the GPUs after those, `tensor_parallel_size` each, in local-rank order. On CPU each rank owns an
slice of the node's cores (`rank_cores`, `cpu_binding`): each engine `per` cores from the top core down (its
process tree bound there, and vLLM's OpenMP threads bound inside it), the trainers an equal share of the rest; an
oversubscribed node, e.g. tests with more ranks than cores, binds nothing, shares cores and says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl_fsdp.config import ConfigError, InferenceConfig
from pipelinerl_fsdp.inference.vllm_config import VLLMInferenceConfig
from pipelinerl_fsdp.job.world import World
from pipelinerl_fsdp.runtime import cpu_binding
from pipelinerl_fsdp.runtime.gpus import gpu_count


@dataclass
class VLLMPlacement:
    """Where an engine runs: CPU cores for vLLM's OpenMP threads, or GPU indices (one per tensor-parallel rank)."""

    cpu_cores: str | None  # VLLM_CPU_OMP_THREADS_BIND value, e.g. "1" or "0-3|4-7"; None: vLLM's own choice
    gpu_ids: list[int] | None  # CUDA_VISIBLE_DEVICES of the engine; None on CPU


def vllm_placement(inf: VLLMInferenceConfig, threads_per_rank: int, world: World) -> VLLMPlacement:
    """Cores (CPU) or GPU indices (GPU) of this inference rank's vLLM engine."""
    local_trainers, local_engines = _local_counts(world)
    if world.backend == "nccl":
        tp = inf.tensor_parallel_size
        first = local_trainers + (world.local_rank - local_trainers) * tp
        ids = list(range(first, first + tp))
        n_gpus = gpu_count()  # NVML: this rank must not initialise CUDA before vLLM starts its processes
        if ids[-1] >= n_gpus:
            raise ConfigError(
                f"rank {world.rank}: its vLLM engine needs GPUs {ids} (inference.tensor_parallel_size "
                f"= {tp}, after the node's {local_trainers} trainer GPU(s)), but the node has "
                f"{n_gpus}"
            )
        return VLLMPlacement(cpu_cores=None, gpu_ids=ids)
    cores = cpu_binding.node_cores()
    per = engine_cores_each(inf, threads_per_rank, world, len(cores))
    engine_index = world.local_rank - local_trainers
    mine = cpu_binding.engine_slice(cores, engine_index, per)
    if local_engines * per + local_trainers > len(cores):
        print(
            f"[rank {world.rank}] warning: {local_engines} engine(s) x {per} core(s) and {local_trainers} trainer(s) "
            f"on a {len(cores)}-core node: oversubscribed; nothing is bound, this engine's threads use cores "
            f"{mine[0]}-{mine[-1]}",
            flush=True,
        )
    tp = inf.tensor_parallel_size
    if per % tp:
        raise ConfigError(
            f"inference.cpu_cores_per_engine = {per} is not a multiple of inference.tensor_parallel_size = {tp}"
        )
    step = len(mine) // tp
    parts = [mine[i * step : (i + 1) * step] for i in range(tp)]
    return VLLMPlacement(cpu_cores="|".join(f"{p[0]}-{p[-1]}" for p in parts), gpu_ids=None)


def engine_cores_each(inf: InferenceConfig, threads_per_rank: int, world: World, n_cores: int) -> int:
    """Cores per vLLM engine on a CPU node: `inference.cpu_cores_per_engine`, else `job.threads_per_rank`, else an
    equal share of the node."""
    share = max(1, n_cores // world.local_world_size)
    return min(n_cores, inf.cores_per_engine or threads_per_rank or share)


def rank_cores(inf: InferenceConfig, threads_per_rank: int, world: World) -> list[int] | None:
    """The cores this rank (and every process it starts) is bound to in a CPU job: its engine's slice (from the
    top down) or its share of the cores the node's engines leave to its trainers; None when the node has fewer
    cores than its ranks need (oversubscribed: nothing is bound)."""
    cores = cpu_binding.node_cores()
    local_trainers, n_engines = _local_counts(world)
    per = engine_cores_each(inf, threads_per_rank, world, len(cores))
    if n_engines * per + local_trainers > len(cores):
        return None
    if world.is_trainer:
        return cpu_binding.trainer_slice(cores, world.local_rank, local_trainers, n_engines, per)
    return cpu_binding.engine_slice(cores, world.local_rank - local_trainers, per)


def _local_counts(world: World) -> tuple[int, int]:
    """(trainer ranks, inference ranks) on this rank's node (trainers have the node's first local ranks)."""
    node_first = world.rank - world.local_rank
    trainers = sum(1 for r in world.trainer_ranks if node_first <= r < node_first + world.local_world_size)
    return trainers, world.local_world_size - trainers
