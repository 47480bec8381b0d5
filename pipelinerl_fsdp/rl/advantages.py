"""Group-baseline advantages: every prompt is sampled G times and each attempt is scored against its group."""

from __future__ import annotations

from collections.abc import Sequence

# added to the group's standard deviation before dividing by it (TRL's GRPOTrainer and ServiceNow/PipelineRL: 1e-4)
STD_EPS = 1e-4


def group_advantages(
    rewards: Sequence[float], baseline: str = "mean", std_normalize: bool = False, eps: float = STD_EPS
) -> list[float]:
    """A_i = r_i - baseline of the group.

    baseline "mean": the group mean (PipelineRL's default); "loo": the mean of the *other* attempts
    (leave-one-out, unbiased). std_normalize divides by the group's *sample* standard deviation (n - 1 in the
    denominator) + eps, as GRPO does in TRL (`scale_rewards = "group"`: `std()` + 1e-4) and ServiceNow/PipelineRL:
    the population std would make every advantage sqrt(G / (G - 1)) larger (1.41 at G = 2). A group of one has
    std 0 (its advantage is 0 either way).
    """
    g = len(rewards)
    if g == 0:
        raise ValueError("empty group")
    mean = sum(rewards) / g
    if baseline == "mean":
        adv = [r - mean for r in rewards]
    elif baseline == "loo":
        if g < 2:
            raise ValueError("leave-one-out baseline needs at least 2 attempts per prompt (rl.attempts)")
        adv = [r - (mean * g - r) / (g - 1) for r in rewards]
    else:
        raise ValueError(f"unknown advantage baseline {baseline!r}; choose 'mean' or 'loo'")
    if std_normalize:
        std = (sum((r - mean) ** 2 for r in rewards) / (g - 1)) ** 0.5 if g > 1 else 0.0
        adv = [a / (std + eps) for a in adv]
    return adv


def is_zero_advantage_group(advantages: Sequence[float], tol: float = 1e-6) -> bool:
    """Every attempt's advantage is 0 (up to float rounding of the baseline): the group carries no learning signal
    (optionally filtered out). Attempts that all scored the same have this, unless something else (a loss's
    overlong punishment) told them apart."""
    return all(abs(a) <= tol for a in advantages)


def overlong_penalty(length: int, max_new_tokens: int, buffer: float, penalty: float) -> float:
    """DAPO's soft overlong punishment (arXiv 2503.14476, eq. 13): 0 up to (1 - buffer) x max_new_tokens, then
    falling linearly to -penalty at max_new_tokens; 0 when `buffer` is 0 (off)."""
    span = buffer * max_new_tokens
    if span <= 0:
        return 0.0
    return min(-(length - (max_new_tokens - span)) / span * penalty, 0.0)


def shaped_group_advantages(
    rewards: Sequence[float],
    lengths: Sequence[int],
    baseline: str,
    std_normalize: bool,
    max_new_tokens: int,
    overlong_buffer: float,
    overlong_penalty_at_max: float,
) -> list[float]:
    """`group_advantages` of the rewards with the loss's overlong punishment added (`overlong_penalty` of each
    completion's length; nothing when `overlong_buffer` is 0). The logged reward stays the task's."""
    shaped = [
        r + overlong_penalty(n, max_new_tokens, overlong_buffer, overlong_penalty_at_max)
        for r, n in zip(rewards, lengths, strict=True)
    ]
    return group_advantages(shaped, baseline, std_normalize)
