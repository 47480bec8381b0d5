"""The sections of the job around the roles: the job itself, the model and tokenizer it starts from, the torchrun
world, checkpoints, metrics and the cluster of `--job.stage=plan`. Each section checks its own keys (`check()`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pipelinerl_fsdp.config.errors import failed


@dataclass
class JobConfig:
    name: str = "arithmetic"
    output_dir: str = "outputs/arithmetic"
    seed: int = 0
    # "warmstart": supervised training of the initial policy only.
    # "rl" (the default: the main job): warm start if its folder is missing, then PipelineRL from that folder (or
    #   from model.path).
    # "plan": print the layout and memory per GPU for the [plan] cluster and exit (plain python, no GPU)
    stage: Literal["warmstart", "rl", "plan"] = "rl"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # torch threads per rank; 0 = the node's cores divided by the ranks on the node
    threads_per_rank: int = 0
    # CPU jobs: bind each rank, and every process it starts (vLLM's engine core and workers, reward workers), to
    # its own slice of the node's cores (engines from the top core down, trainers below), so that generation and
    # training never compete for a core; nothing is bound on an oversubscribed node or on GPU
    bind_cores: bool = True
    # show third-party logs (vLLM's per-step and per-update INFO lines, its warnings on weight reloads)
    debug: bool = False
    # restarts of the whole job after a failed process (torchrun --max-restarts, passed by run_train.sh and the
    # SLURM wrapper; the MAX_RESTARTS environment variable overrides it): a restarted job resumes from the newest
    # intact checkpoint (checkpoint.resume = "auto"), so set checkpoint.interval too
    max_restarts: int = 0

    def check(self) -> list[tuple[str, str]]:
        """(key, what it must be) for every impossible value; empty when the values are fine."""
        return failed(
            [
                ("threads_per_rank", self.threads_per_rank >= 0, ">= 0"),
                ("max_restarts", self.max_restarts >= 0, ">= 0"),
            ]
        )


@dataclass
class ModelConfig:
    # HF folder to start from; empty: build `flavour` with random weights
    path: str = ""
    flavour: str = "debug"


@dataclass
class TokenizerConfig:
    """The job's one tokenizer and how prompts go through it."""

    # HF tokenizer folder used by every stage (warm start, trainer, engines); empty: the model folder's
    # tokenizer, or (warm start from scratch) a character tokenizer of the task's alphabet
    path: str = ""
    # prompts as a user turn of the tokenizer's chat template (with the generation prompt)
    use_chat_template: bool = False
    # a system turn before the user turn (chat template only; empty: none)
    system_prompt: str = ""
    # extra variables for the chat template, e.g. { enable_thinking = false } (Qwen3)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorldConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # how many of the torchrun ranks host a generation engine (the highest ranks; trainers keep the low ones)
    inference_ranks: int = 0
    # collective time-out: a rank stuck longer than this fails instead of hanging
    timeout_s: int = 600
    # weight broadcast bucket size (whole layers per bucket)
    weight_bucket_mb: int = 64

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("timeout_s", self.timeout_s >= 10, ">= 10 seconds"),
                ("inference_ranks", self.inference_ranks >= 0, ">= 0"),
                ("weight_bucket_mb", self.weight_bucket_mb >= 1, ">= 1"),
            ]
        )


@dataclass
class CheckpointConfig:
    # save a DCP checkpoint every `interval` RL steps (0: never)
    interval: int = 0
    # default: <job.output_dir>/checkpoints
    folder: str = ""
    # "auto": a (re)started job continues from the newest intact checkpoint in `folder` when there is one;
    # "required": the same, an error when there is none; "off": always start from step 0
    resume: Literal["auto", "required", "off"] = "auto"
    # resume from this checkpoint folder (a step-NNNNNNN folder) instead; it must be intact
    resume_from: str = ""
    keep: int = 2
    # also write the policy as an HF folder every this many RL steps, <job.output_dir>/exports/step-NNNNNNN
    # (weights, config, tokenizer; 0: only the final export to <job.output_dir>/final): a learning curve to
    # evaluate offline, outside the timed run (benchmarks/learning_speed.py)
    export_every: int = 0
    # on SIGTERM / SIGINT (Ctrl-C, scancel, preemption) the trainer saves the steps done since the last checkpoint
    # before exiting (within torchrun's 30 s); false: exit at once, losing up to one interval
    save_on_stop: bool = True

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("interval", self.interval >= 0, ">= 0"),
                ("export_every", self.export_every >= 0, ">= 0"),
                ("keep", self.keep >= 1, ">= 1"),
            ]
        )

    def folder_under(self, output_dir: str) -> Path:
        """The checkpoint folder: `folder`, else <job.output_dir>/checkpoints."""
        return Path(self.folder or Path(output_dir) / "checkpoints")


@dataclass
class MetricsConfig:
    log_every: int = 10
    tensorboard: bool = True
    # write the trained batch to <output_dir>/rl/rollouts/step-N.jsonl every this many steps (0: never, 1: all)
    rollouts_every: int = 0
    # rollouts per console-logged step in TensorBoard's text tab (0: none)
    rollouts_in_tensorboard: int = 2

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("log_every", self.log_every >= 1, ">= 1"),
                ("rollouts_every", self.rollouts_every >= 0, ">= 0"),
                ("rollouts_in_tensorboard", self.rollouts_in_tensorboard >= 0, ">= 0"),
            ]
        )


@dataclass
class PlanConfig:
    """The cluster `--job.stage=plan` lays the job out on (see pipelinerl_fsdp/plan.py)."""

    nodes: int = 1
    gpus_per_node: int = 8
    # torchrun processes per node; 0: one per GPU
    procs_per_node: int = 0
    gpu_memory_gib: float = 80.0
    # The performance prediction after the memory plan (pipelinerl_fsdp/plan_performance.py): the job simulator
    # (pipelinerl_fsdp/perf/) on this cluster. Off: the memory plan only.
    predict: bool = True
    # the GPU's datasheet (bf16 peak, HBM and link bandwidths): one of GPU_KINDS (perf/spec.py's presets)
    gpu: str = "h100"
    # a measured profile (benchmarks.perf_profile's JSON) instead of the spec; "": the spec
    profile: str = ""
    # the trainer's model FLOPs utilisation the spec-based step assumes
    mfu: float = 0.35
    # the network's bandwidth per GPU between nodes, GB/s; 0: the GPU preset's (a DGX: 400 Gb/s a GPU = 50)
    inter_node_gbs: float = 0.0
    # completion lengths: a lengths file (perf/data/*.json: quantiles) or a folder of rollout dumps; "": the task's
    # own distribution where it has one (countdown), else perf/data/math_reasoning_lengths.json
    lengths: str = ""

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("nodes", self.nodes >= 1, ">= 1"),
                ("gpus_per_node", self.gpus_per_node >= 1, ">= 1"),
                ("procs_per_node", self.procs_per_node >= 0, ">= 0"),
                ("gpu_memory_gib", self.gpu_memory_gib > 0, "> 0"),
                ("gpu", self.gpu in GPU_KINDS, f"one of {', '.join(GPU_KINDS)}"),
                ("mfu", 0 < self.mfu <= 1, "in (0, 1]"),
                ("inter_node_gbs", self.inter_node_gbs >= 0, ">= 0 (0: the GPU preset's)"),
            ]
        )


# the GPU presets of pipelinerl_fsdp/perf/spec.py (a test keeps the two lists equal)
GPU_KINDS = ("h100", "h200", "a100")
