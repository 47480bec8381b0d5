"""The vLLM engine's own keys (`[inference]` when `inference.engine = "vllm"`): its KV cache and cores on CPU, its
GPUs and CUDA graphs on GPU, its step size and how its workers load an update. Beside the engine, so that adding an
engine never edits the shared schema (engine_kinds.py names this class)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pipelinerl_fsdp.config import InferenceConfig
from pipelinerl_fsdp.config.errors import failed

# how a vLLM worker loads an update (inference/vllm_load.py): reload (vLLM's generic reload_weights), inplace (the
# model's load_weights; CPU linears repacked), unpacked (CPU linears unpacked: copies only)
WeightLoad = Literal["auto", "reload", "inplace", "unpacked"]


@dataclass
class VLLMInferenceConfig(InferenceConfig):
    # vLLM on CPU: KV-cache GiB per engine (0: sized from the config, see vllm_options.kv_cache_gib_needed) and
    # cores per engine for its OpenMP threads
    # (VLLM_CPU_OMP_THREADS_BIND; 0: job.threads_per_rank, else the node's cores / ranks on the node)
    kv_cache_gib: float = 0.0
    cpu_cores_per_engine: int = 0
    # vLLM on GPU: fraction of each engine GPU's memory vLLM may use; GPUs per engine (tensor parallelism)
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    # vLLM on GPU: capture CUDA graphs for decoding (false: eager, slower, starts faster); CPU engines are eager
    cuda_graphs: bool = True
    # vLLM: tokens per engine step; 0: every slot's whole context on CPU (a split prompt crashes seeded sampling
    # there), vLLM's default on GPU
    max_num_batched_tokens: int = 0
    # auto: inplace on GPU, on CPU unpacked up to hidden size 256, else inplace
    vllm_weight_load: WeightLoad = "auto"

    @property
    def gpus_per_engine(self) -> int:
        return self.tensor_parallel_size

    @property
    def cores_per_engine(self) -> int:
        return self.cpu_cores_per_engine

    def check(self) -> list[tuple[str, str]]:
        return super().check() + failed(
            [
                ("kv_cache_gib", self.kv_cache_gib >= 0, ">= 0 (0: sized from the config)"),
                ("cpu_cores_per_engine", self.cpu_cores_per_engine >= 0, ">= 0"),
                ("gpu_memory_utilization", 0 < self.gpu_memory_utilization <= 1, "in (0, 1]"),
                ("tensor_parallel_size", self.tensor_parallel_size >= 1, ">= 1"),
                ("max_num_batched_tokens", self.max_num_batched_tokens >= 0, ">= 0"),
            ]
        )
