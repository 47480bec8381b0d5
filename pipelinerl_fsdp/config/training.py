"""The sections of the trainer side: the RL stage (`[rl]`), the loss every objective extends (`[loss]`), the
trainer and its optimizer, and the supervised warm start. Each section checks its own keys (`check()`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pipelinerl_fsdp.config.errors import failed

# How the step's per-token losses are summed into one (rl/normalization.py): "sequences": / B, the step's sequences
# (the PipelineRL paper); "tokens": / the step's completion tokens (DAPO's token mean); "sequence_mean": each
# sequence's token mean, / B (GRPO); "group_mean": each group's token mean, / the step's groups; "constant":
# / (B x task.max_new_tokens) (Dr. GRPO)
Normalization = Literal["sequences", "tokens", "sequence_mean", "group_mean", "constant"]


@dataclass
class LossConfig:
    """Keys every loss has (`[loss]`); a loss's `config_class` (pipelinerl_fsdp/rl/objectives/) extends it with its
    own keys and its own defaults for these."""

    # whether the loss's paper divides each advantage by its group's standard deviation: the default of
    # rl.std_normalize under this loss (a class attribute, not a key; rl.std_normalize set explicitly wins)
    advantage_std: ClassVar[bool] = False

    name: str = "reinforce_tis"
    normalize: Normalization = "sequences"
    # engine/trainer mismatch masking (MIS, IcePop): "token": tokens whose ratio pi/mu lies outside
    # [mask_low, mask_high] leave the loss; "sequence": whole sequences whose geometric-mean ratio does
    mask: Literal["none", "token", "sequence"] = "none"
    mask_low: float = 0.5
    mask_high: float = 2.0
    # lag masking: completion tokens sampled more than max_token_lag versions before the version being trained leave
    # the loss (weight 0, like the mismatch mask's; counted in masked_frac); -1: off. Unlike rl.max_lag, which drops
    # whole samples, it keeps a long completion's recent tokens
    max_token_lag: int = -1
    # truncated completions (cut at task.max_new_tokens) leave the loss; they still count in their group's baseline
    overlong_filter: bool = False
    # DAPO's soft overlong punishment: a completion longer than (1 - overlong_buffer) x task.max_new_tokens has its
    # reward lowered by overlong_penalty x (length past that) / (overlong_buffer x task.max_new_tokens) for its
    # advantage (the logged reward stays the task's); 0: off
    overlong_buffer: float = 0.0
    overlong_penalty: float = 1.0

    def check(self) -> list[tuple[str, str]]:
        """(key, what it must be) for every impossible value; empty when the values are fine."""
        return failed(
            [
                ("mask_low", 0 < self.mask_low <= 1, "in (0, 1]"),
                ("mask_high", self.mask_high >= 1, ">= 1"),
                ("max_token_lag", self.max_token_lag >= -1, ">= 0, or -1 (off)"),
                ("overlong_buffer", 0 <= self.overlong_buffer < 1, "in [0, 1) (a fraction of task.max_new_tokens)"),
                ("overlong_penalty", self.overlong_penalty >= 0, ">= 0"),
            ]
        )


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
        return failed(
            [
                ("lr", self.lr > 0, "> 0"),
                ("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
                ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
                ("weight_decay", self.weight_decay >= 0, ">= 0"),
                ("betas", len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "two numbers in [0, 1)"),
                ("eps", self.eps > 0, "> 0"),
                ("grad_clip", self.grad_clip > 0, "> 0"),
            ]
        )


@dataclass
class TrainerConfig:
    # the RL stage's optimizer ([trainer.optimizer] in TOML, --trainer.optimizer.lr=... on the command line)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # token budget of one packed micro-batch on one rank; "auto": 4096 on CPU, on GPU the largest of 32768, 16384,
    # 8192, 4096 whose trainer memory the plan (plan.py) keeps within 90% of plan.gpu_memory_gib (or of the smallest
    # GPU the job finds, where less); the resolved value is saved in the run's config.toml
    micro_batch_tokens: int | Literal["auto"] = "auto"
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
    # last micro-batch (4 bytes per parameter per GPU: 30 GB at 7B). "auto": false on CPU; on GPU true when the
    # plan fits it beside the micro-batch "auto" chose (or the one set), else false; saved resolved in config.toml
    defer_grad_sync: bool | Literal["auto"] = "auto"
    # the output head's precision under bf16 mixed precision (the importance ratios need fp32 log-probs):
    # "auto": the root (embeddings, final norm, head) in bf16, the head's GEMMs on bf16 operands with fp32
    # accumulation and fp32 logits (tensor cores; logits never rounded to bf16); "on": the root kept and computed
    # in fp32 (fp32 GEMMs, ~15x slower on an H100); "off": as "auto" with the logits rounded to bf16 (a control).
    # With fp32 parameters (CPU) all three are the same fp32 head
    fp32_head: Literal["auto", "on", "off"] = "auto"
    # torch.compile each decoder block's parts around attention (norms, residuals, MLP; training/parallelize.py):
    # "auto": on the devices where compiled blocks were measured faster (none yet: `training.parallelize.
    # resolve_compile`; the GPU check compares them on a GPU), "on" / "off" as said
    compile: Literal["auto", "on", "off"] = "auto"

    def decided(self) -> tuple[int, bool]:
        """(micro_batch_tokens, defer_grad_sync) once the job has decided its "auto" ones for its device
        (`plan.resolve_trainer_defaults`); an error while either is still "auto"."""
        if self.micro_batch_tokens == "auto" or self.defer_grad_sync == "auto":
            raise ValueError(
                "trainer.micro_batch_tokens / trainer.defer_grad_sync are still 'auto': the job decides them by "
                "its device at start-up (plan.resolve_trainer_defaults); set them to use the trainer without it"
            )
        return self.micro_batch_tokens, self.defer_grad_sync

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("micro_batch_tokens", self.micro_batch_tokens == "auto" or self.micro_batch_tokens >= 16, ">= 16"),
                ("logprob_chunk_size", self.logprob_chunk_size >= 1, ">= 1"),
                ("max_nonfinite_steps", self.max_nonfinite_steps >= 1, ">= 1"),
                ("ac_every", self.ac_every >= 1, ">= 1"),
            ]
        )


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

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("path", bool(self.path), "a non-empty folder path"),
                ("steps", self.steps >= 0, ">= 0"),
                ("batch_size", self.batch_size >= 1, ">= 1"),
                ("eval_every", self.eval_every >= 1, ">= 1"),
                ("min_accuracy", 0 <= self.min_accuracy <= 1, "in [0, 1]"),
                ("stop_at_accuracy", 0 <= self.stop_at_accuracy <= 1, "in [0, 1]"),
            ]
        )


@dataclass
class RLConfig:
    # pipeline: in-flight weight updates after every optimizer step (engines never stop);
    # conventional: engines generate sync_every x batch_size samples with frozen weights, then idle while the
    #   trainer takes sync_every (= G) steps on them, then the weights are synced (lag <= G - 1);
    # async: engines keep generating while the trainer trains, but take new weights only between sequences
    #   (they stop admitting requests, drain, then load: one version per sequence);
    # colocated: the baseline, one process (no torchrun) that generates, then trains, and again, on the weights it
    #   has just trained (training/colocated.py)
    mode: Literal["pipeline", "conventional", "async", "colocated"] = "pipeline"
    # attempts per prompt (the group of the baseline)
    attempts: int = 8
    # sequences per optimizer step, all trainer ranks together
    batch_size: int = 64
    max_steps: int = 100
    # KL penalty (k3 estimator) to the frozen initial policy; 0 disables it (the paper's setting)
    kl_coef: float = 0.0
    baseline: Literal["mean", "loo"] = "mean"
    # divide each advantage by its group's sample std (+1e-4); unset: as the loss's paper does (true for grpo, dapo,
    # gspo, cispo; false for reinforce_tis, the PipelineRL paper's, ppo and dr_grpo); the resolved value is saved
    # in the run's config.toml
    std_normalize: bool | None = None
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

    def check(self) -> list[tuple[str, str]]:
        return failed(
            [
                ("attempts", self.attempts >= 1, ">= 1"),
                ("batch_size", self.batch_size >= 1, ">= 1"),
                ("max_steps", self.max_steps >= 1, ">= 1"),
                ("max_lag", self.max_lag >= 0, ">= 0"),
                ("kl_coef", self.kl_coef >= 0, ">= 0"),
                ("sync_every", self.sync_every >= 1, ">= 1"),
                ("waves", self.waves >= 1, ">= 1"),
                ("check_mismatch", self.check_mismatch >= 0, ">= 0 (0: no check)"),
            ]
        )
