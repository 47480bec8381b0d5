"""One optimizer step over packed micro-batches, with every trainer rank in lockstep.

FSDP2 needs every rank to run the same number of forward/backward passes. Ranks agree on the micro-batch count
with an all_reduce; a rank that has run out of data runs a one-token dummy pass whose loss is multiplied by zero,
so it still joins every collective and contributes nothing to the gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from pipelinerl_fsdp import records
from pipelinerl_fsdp.config import LossConfig
from pipelinerl_fsdp.models.decoder import Transformer
from pipelinerl_fsdp.models.lora import adapters_disabled
from pipelinerl_fsdp.rl.batching import RLMicroBatch
from pipelinerl_fsdp.rl.loss import micro_batch_loss
from pipelinerl_fsdp.rl.packing import PackedRow

M = TypeVar("M", bound=PackedRow)
S = TypeVar("S")
R = TypeVar("R")
# (logp [1, T], entropy [1, T], micro-batch) -> (loss to backpropagate, the micro-batch's statistics for logging)
LossFn = Callable[[torch.Tensor, torch.Tensor, M], tuple[torch.Tensor, S]]
_OPS = {records.SUM: dist.ReduceOp.SUM, records.MAX: dist.ReduceOp.MAX}


def rl_loss_fn(cfg: LossConfig, kl_coef: float, n_ranks: int) -> LossFn[RLMicroBatch, torch.Tensor]:
    """The RL step's loss per micro-batch: the policy loss, whose per-sample weights already normalise it over the
    whole step (rl/normalization.py), times `n_ranks`, because FSDP averages the gradients over the ranks while
    each rank's loss is already a share of the global sum (`tests/dist/dp_equivalence.py`: 1 and 2 ranks get the
    same gradients). Its statistics stay on the device (`rl.loss.stat_sums`): the step reads them once."""

    def loss_fn(logp: torch.Tensor, ent: torch.Tensor, mb: RLMicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        loss, sums = micro_batch_loss(logp, ent, mb.loss_input, cfg, kl_coef)
        return loss * n_ranks, sums

    return loss_fn


def _dummy_micro_batch(device: torch.device) -> PackedRow:
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    return PackedRow(one, one, one, one)


def agree_max(value: int, group: dist.ProcessGroup | None) -> int:
    """The maximum of `value` over the ranks of `group`, agreed over the group's CPU backend (gloo; the trainer
    group has one beside NCCL): a host count, so reading it never waits for the GPU's queue (the previous step's
    optimizer work may still run there)."""
    t = torch.tensor([value], dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def sum_over_ranks(values: list[float], group: dist.ProcessGroup | None, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def reduce_over_ranks(record: R, group: dist.ProcessGroup | None, device: torch.device) -> R:
    """A record (records.py) combined over the ranks of `group`, each field with its reduction (float64)."""
    flat = torch.tensor(records.values(record), dtype=torch.float64, device=device)
    return records.from_values(record, reduce_values_over_ranks(flat, type(record), group).tolist())


def reduce_values_over_ranks(flat: torch.Tensor, record_type: type, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A record's `records.values` as a float64 tensor on the device, combined over the ranks of `group` there: one
    all_reduce per reduction the record's fields use, each over the whole vector with the other reductions' values
    at that reduction's identity (0 for a sum, -inf for a maximum), so that nothing waits for the host."""
    kinds = records.reductions(record_type)
    if len(kinds) == 1:
        flat = flat.clone()
        dist.all_reduce(flat, op=_OPS[kinds[0]], group=group)
        return flat
    is_max = torch.zeros_like(flat, dtype=torch.bool)
    for i in records.positions(record_type, records.MAX):  # few: set one by one, on the device
        is_max[i] = True
    out = flat.clone()
    for kind in kinds:
        mine = is_max if kind == records.MAX else ~is_max
        identity = 0.0 if kind == records.SUM else float("-inf")
        t = torch.where(mine, flat, torch.full_like(flat, identity))
        dist.all_reduce(t, op=_OPS[kind], group=group)
        out = torch.where(mine, t, out)
    return out


def row_logprobs(
    model: Transformer, mb: PackedRow, temperature: float, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's (log-probs, entropies) of a packed row's targets at the loss's positions only (the dummy pass:
    its one token), with the packer's offsets and indices: no device read in the forward."""
    return model(
        mb.input_ids,
        mb.position_ids,
        targets=mb.targets,
        temperature=temperature,
        logprob_chunk_size=chunk_size,
        logprob_positions=mb.logprob_positions(),
        documents=mb.documents,
        logprob_index=mb.logprob_index,
    )


def forward_backward(
    model: Transformer,
    micro_batches: Sequence[M],
    loss_fn: LossFn[M, S],
    temperature: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    chunk_size: int = 1024,
    defer_grad_sync: bool = False,
    final: bool = True,
) -> list[S]:
    """Accumulate gradients over this rank's micro-batches (lockstep with the other ranks).

    Gradients are reduce-scattered after every micro-batch (each rank keeps only its shard); `defer_grad_sync`
    reduces once after the step's last one instead (`trainer.defer_grad_sync`): the last of this call when `final`,
    else a later call's (a step whose batch comes in parts, `rl.waves`). Returns the statistics of each of this
    rank's micro-batches (callers combine them, and reduce them across ranks).
    """
    n = agree_max(len(micro_batches), group)
    stats: list[S] = []
    for i in range(n):
        real = i < len(micro_batches)
        mb = micro_batches[i] if real else _dummy_micro_batch(device)
        model.set_requires_gradient_sync(not defer_grad_sync or (final and i == n - 1))
        logp, ent = row_logprobs(model, mb, temperature, chunk_size)
        if real:
            loss, s = loss_fn(logp, ent, micro_batches[i])
            stats.append(s)
        else:
            loss = logp.sum() * 0.0
        loss.backward()
    return stats


@torch.no_grad()
def add_reference_logprobs(
    ref_model: Transformer,
    micro_batches: list[RLMicroBatch],
    temperature: float,
    group: dist.ProcessGroup | None,
    device: torch.device,
    chunk_size: int = 1024,
) -> None:
    """Log-probs of the targets under a frozen reference model, stored as the micro-batches' `ref_logp` (lockstep).
    Under LoRA `ref_model` may be the policy itself: its adapters are off here (`adapters_disabled`), so it is the
    base."""
    n = agree_max(len(micro_batches), group)
    for i in range(n):
        mb: PackedRow = micro_batches[i] if i < len(micro_batches) else _dummy_micro_batch(device)
        with adapters_disabled(ref_model):
            logp, _ = row_logprobs(ref_model, mb, temperature, chunk_size)
        if i < len(micro_batches):
            micro_batches[i].loss_input.ref_logp = logp[0]


def clip_and_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_norm: float,
) -> float:
    """Clip the global gradient norm, step optimizer and schedule; returns the pre-clip norm. A non-finite norm
    (a NaN/inf loss or gradient anywhere: the norm is global, so every rank sees it) applies nothing: the gradients
    are dropped and neither the optimizer nor the schedule moves."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    if torch.isfinite(norm):
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)
