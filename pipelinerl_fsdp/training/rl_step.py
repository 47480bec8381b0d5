"""The RL optimizer step on a batch of samples, one for the pipeline trainer and the colocated mode: packed
micro-batches, the reference model's log-probs (`rl.kl_coef`), forward/backward with the job's loss over the
batch's parts (`rl.waves`), then clipping, AdamW and the schedule (`Policy.step`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipelinerl_fsdp.config import LossConfig, TrainerConfig
from pipelinerl_fsdp.models.decoder import Transformer
from pipelinerl_fsdp.rl.batching import rl_micro_batches
from pipelinerl_fsdp.rl.loss import LossStats, stats_from_sums, total_sums
from pipelinerl_fsdp.samples import Sample
from pipelinerl_fsdp.training.policy import Policy
from pipelinerl_fsdp.training.train_step import (
    add_reference_logprobs,
    forward_backward,
    reduce_values_over_ranks,
    rl_loss_fn,
)


@dataclass
class RLStep:
    """The step's models and settings, fixed for the run; `run` takes one optimizer step (collective over `group`,
    the trainer ranks; None: the default group)."""

    policy: Policy
    # the frozen initial policy (rl.kl_coef > 0), sharded like the trained one; under LoRA the policy's own model,
    # run with its adapters off (`add_reference_logprobs`)
    ref_model: Transformer | None
    loss: LossConfig
    kl_coef: float
    trainer: TrainerConfig
    temperature: float  # the engines' sampling temperature: log-probs are those of the sampling distribution
    group: dist.ProcessGroup | None
    device: torch.device
    n_ranks: int

    def run(
        self,
        parts: Iterable[list[Sample]],
        n_parts: int,
        version: int,
        before_update: Callable[[LossStats], None] | None = None,
    ) -> tuple[LossStats, float]:
        """Forward/backward on each of this rank's `n_parts` parts of the batch (taken from `parts` one at a time,
        so a part is trained as soon as it is in hand), `before_update(sums)`, then the optimizer step. Returns
        the step's loss statistics reduced over the ranks of `group` (once, before `before_update`, which reads
        them too) and the pre-clip gradient norm (non-finite: nothing was applied)."""
        trainer = self.trainer
        budget, defer = trainer.decided()
        loss_fn = rl_loss_fn(self.loss, self.kl_coef, self.n_ranks)
        waves: list[torch.Tensor] = []  # each part's statistics, summed on the device (`rl.loss.stat_sums`)
        for i, mine in zip(range(n_parts), parts):
            micro = rl_micro_batches(mine, budget, self.device, version)
            if self.ref_model is not None:
                add_reference_logprobs(
                    self.ref_model,
                    micro,
                    self.temperature,
                    self.group,
                    self.device,
                    trainer.logprob_chunk_size,
                )
            part_stats = forward_backward(
                self.policy.model,
                micro,
                loss_fn,
                self.temperature,
                self.group,
                self.device,
                trainer.logprob_chunk_size,
                defer,
                final=i == n_parts - 1,
            )
            waves.append(total_sums(part_stats, self.device))
        # the step's one read of its statistics: reduced over the ranks on the device, then one copy to the host
        sums = stats_from_sums(reduce_values_over_ranks(total_sums(waves, self.device), LossStats, self.group))
        if before_update is not None:
            before_update(sums)
        return sums, self.policy.step()
