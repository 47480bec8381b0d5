"""The RL step's loss statistics stay on the device: summed there over the step's micro-batches, reduced over the
ranks there, read on the host once; every value equal to reading each micro-batch's on the host and combining
them there (`records.total`, `reduce_over_ranks`), on a fixed batch that fills every field."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from pipelinerl_fsdp.records import total, values
from pipelinerl_fsdp.rl.batching import RLMicroBatch, rl_micro_batches
from pipelinerl_fsdp.rl.loss import LossStats, stats_from_sums, total_sums
from pipelinerl_fsdp.rl.objectives import CONFIGS
from pipelinerl_fsdp.samples import ENV_VERSION, Sample
from pipelinerl_fsdp.training.train_step import reduce_over_ranks, reduce_values_over_ranks, rl_loss_fn

CPU = torch.device("cpu")
VERSION = 7


@pytest.fixture(scope="module")
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def step_batch(seed: int = 0) -> list[tuple[RLMicroBatch, torch.Tensor, torch.Tensor]]:
    """Micro-batches of a step (lags 0..3, updates within sequences, environment turns, completions past every
    position bin), each with the trainer's log-probs and entropies ([1, T]) and the reference's log-probs."""
    rng = random.Random(seed)
    samples = []
    for i in range(12):
        n = rng.randint(3, 180)
        first = VERSION - rng.randint(0, 3)
        versions = [min(VERSION, first + j // 50) for j in range(n)]
        if i % 3 == 0:  # a multi-turn rollout: an environment turn in the middle
            versions[n // 3 : n // 3 + 4] = [ENV_VERSION] * 4
        samples.append(
            Sample(
                i // 4,
                [1] * rng.randint(2, 9),
                [rng.randint(2, 60) for _ in range(n)],
                [-rng.random() * 3 for _ in range(n)],
                versions,
                1.0,
                advantage=rng.uniform(-1, 1),
                loss_weight=1 / 12,
            )
        )
    out = []
    g = torch.Generator().manual_seed(seed)
    for mb in rl_micro_batches(samples, 300, CPU, VERSION):
        t = mb.loss_input.mask.shape[0]
        logp = (mb.loss_input.behaviour_logp + 0.3 * torch.randn(t, generator=g))[None]
        mb.loss_input.ref_logp = logp[0] + 0.1 * torch.randn(t, generator=g)
        out.append((mb, logp, torch.rand(1, t, generator=g)))
    return out


def test_the_steps_statistics_read_once_equal_those_read_per_micro_batch(group):
    batch = step_batch()
    assert len(batch) >= 3  # several micro-batches to sum
    cfg = CONFIGS["reinforce_tis"](mask="token", max_token_lag=2)
    loss_fn = rl_loss_fn(cfg, kl_coef=0.1, n_ranks=1)
    sums = [loss_fn(logp, ent, mb)[1] for mb, logp, ent in batch]
    host = reduce_over_ranks(total([stats_from_sums(s) for s in sums], LossStats()), None, CPU)
    device = stats_from_sums(reduce_values_over_ranks(total_sums(sums, CPU), LossStats, None))
    assert device == host
    # every kind of field has something in it: the comparison covers them all
    assert device.kl > 0 and device.masked > 0 and device.lag0_after_update_tokens > 0 and device.mis_tokens > 0
    assert all(x > 0 for x in device.lag0_tokens_pos) and device.turn_tokens[1] > 0 and min(device.tenth_tokens) > 0
    assert device.max_log_ratio > 0 and len(values(device)) == sums[0].numel()


def test_a_rank_without_micro_batches_adds_the_identity(group):
    empty = stats_from_sums(total_sums([], CPU))
    assert empty == LossStats()
