"""How a step's per-token losses are summed into one (`loss.normalize`), as a weight per sample (pure).

Every generated token of sample i enters the step's loss as w_i * l_t; the weights are set once the step's batch
(or the part of it a wave brings, `rl.waves`) is in hand, before it is split over trainer ranks, so the loss is the
same whatever the split, the packing or the number of ranks. B is the step's samples (`rl.batch_size`), n_i the
completion tokens of sample i that a policy sampled (a multi-turn rollout's environment tokens are not counted).

- sequences:     w_i = 1 / B                       (the PipelineRL paper: token sums averaged over sequences)
- tokens:        w_i = 1 / sum_j n_j               (DAPO: a mean over the step's tokens; needs the whole step)
- sequence_mean: w_i = 1 / (B n_i)                 (GRPO, GSPO: each sequence's token mean, averaged)
- group_mean:    w_i = 1 / (G sum_{j in g(i)} n_j) (each group's token mean, averaged over the step's G groups)
- constant:      w_i = 1 / (B L)                   (Dr. GRPO; L = task.max_new_tokens)

Samples left out of the loss (`counted` False: overlong filtering) get 0 and count in no token total.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelinerl_fsdp.config import LossConfig
from pipelinerl_fsdp.samples import Sample


def sample_weights(
    lengths: Sequence[int],
    groups: Sequence[int],
    counted: Sequence[bool],
    mode: str,
    batch_size: int,
    n_groups: int,
    max_new_tokens: int,
) -> list[float]:
    """The loss weight of each sample (see the module docstring); `lengths` are completion tokens, `groups` each
    sample's group id, `batch_size` and `n_groups` the whole step's (not a wave's)."""
    n = [length if c else 0 for length, c in zip(lengths, counted, strict=True)]
    if mode == "sequences":
        out = [1.0 / batch_size] * len(n)
    elif mode == "tokens":
        total = sum(n)
        out = [1.0 / total if total else 0.0] * len(n)
    elif mode == "sequence_mean":
        out = [1.0 / (batch_size * k) if k else 0.0 for k in n]
    elif mode == "group_mean":
        per_group: dict[int, int] = {}
        for g, k in zip(groups, n):
            per_group[g] = per_group.get(g, 0) + k
        out = [1.0 / (n_groups * per_group[g]) if per_group[g] else 0.0 for g in groups]
    elif mode == "constant":
        out = [1.0 / (batch_size * max_new_tokens)] * len(n)
    else:
        raise ValueError(f"loss.normalize: unknown mode {mode!r}")
    return [w if c else 0.0 for w, c in zip(out, counted)]


def assign_loss_weights(
    samples: Sequence[Sample], cfg: LossConfig, batch_size: int, attempts: int, max_new_tokens: int
) -> None:
    """Set each sample's `loss_weight` (`loss.normalize`; a truncated one 0 with `loss.overlong_filter`).
    `samples`: whole groups, the step's batch or one wave of it; `batch_size`, `attempts`: the step's."""
    counted = [s.finished or not cfg.overlong_filter for s in samples]
    weights = sample_weights(
        [s.model_tokens for s in samples],
        [s.group_id for s in samples],
        counted,
        cfg.normalize,
        batch_size,
        batch_size // attempts,
        max_new_tokens,
    )
    for s, w in zip(samples, weights):
        s.loss_weight = w
